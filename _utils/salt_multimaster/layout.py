"""
Where salt-multimaster keeps things on a master, defined once for the primary
(runner, reactor) and the peer (``multimaster_peer``) alike.
"""

import os

from salt_multimaster import statefile

#: The two ways masters share a key: ``shared`` (one master.pem on every
#: master) or ``signed`` (one master_sign.pem; each master its own key).
TOPOLOGIES = ("shared", "signed")


def master_dropin(opts, name):
    """
    The drop-in ``name`` of the master whose options are ``opts``: in the
    directory of its ``default_include`` (the first pattern when it is a
    list; ``master.d/*.conf`` by default), beside its ``conf_file``.
    """
    include = opts.get("default_include") or "master.d/*.conf"
    if isinstance(include, (list, tuple)):
        include = include[0] if include else "master.d/*.conf"
    conf_dir = os.path.dirname(opts["conf_file"])
    return os.path.join(conf_dir, os.path.dirname(str(include)), name)


def state_dir(opts):
    """
    ``<cachedir>/multimaster`` (0700), created on first use (what stands in
    its way moved aside, :func:`statefile.makedirs`).
    """
    path = os.path.join(opts["cachedir"], "multimaster")
    if not os.path.isdir(path):
        statefile.makedirs(path, opts["cachedir"])
    return path


def master_key_files(opts, topology):
    """
    ``(pem, pub)``: the files this master loads for the replicated keypair.

    ``signed``: ``<master_sign_key_name>.pem/.pub``.  ``shared``: the target of
    ``master.pem``/``master.pub`` when they are links, else Salt 3008's
    ``<id>.pem``/``<id>.pub`` when present, else ``master.pem``/``master.pub``
    (Salt 3006/3007, or a master that never started).
    """
    pki = opts["pki_dir"]
    if topology == "signed":
        name = opts.get("master_sign_key_name") or "master_sign"
        return os.path.join(pki, f"{name}.pem"), os.path.join(pki, f"{name}.pub")
    master_id = str(opts.get("id") or "").removesuffix("_master")
    ret = []
    for ext in ("pem", "pub"):
        link = os.path.join(pki, f"master.{ext}")
        by_id = os.path.join(pki, f"{master_id}.{ext}")
        if os.path.islink(link):
            ret.append(os.path.realpath(link))
        elif master_id and os.path.exists(by_id):
            ret.append(by_id)
        else:
            ret.append(link)
    return tuple(ret)
