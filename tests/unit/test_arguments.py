"""
Every public function of every loader module (runners, execution modules,
states) answers a misspelt keyword argument with the full list of the
arguments it accepts and the closest match, before anything runs
(``salt_multimaster.guard``); Salt sees a signature taking ``**kwargs``, so
it hands the keyword over instead of refusing or dropping it in its own
words.
"""

import importlib.util
import inspect

import pytest
import salt.utils.args
from salt.exceptions import SaltInvocationError

from salt_multimaster import guard, minion_config, rotation_steps
from tests.conftest import REPO

LOADER_MODULES = {
    "runner multimaster": ("_runners/multimaster.py", "multimaster"),
    "runner multimaster_reactor": ("_runners/multimaster_reactor.py", "multimaster_reactor"),
    "module multimaster": ("_modules/multimaster.py", "multimaster"),
    "module multimaster_peer": ("_modules/multimaster_peer.py", "multimaster_peer"),
    "state multimaster": ("_states/multimaster.py", "multimaster"),
}


def _load(kind):
    path, _ = LOADER_MODULES[kind]
    spec = importlib.util.spec_from_file_location(f"mm_args_{kind.replace(' ', '_')}",
                                                  REPO / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.__opts__ = {"id": "m1", "test": False}
    mod.__context__ = {}
    mod.__salt__ = {}
    mod.__pillar__ = {}
    mod.__grains__ = {}
    return mod


def public_functions(mod):
    """What Salt's loader would publish of ``mod``: its own functions not starting with _."""
    return {name: func for name, func in vars(mod).items()
            if not name.startswith("_") and inspect.isfunction(func)
            and func.__module__ == mod.__name__}


# what a function's **kwargs accepts, beyond its named parameters
EXTRA = {
    ("runner multimaster", "sync"): ("backup_keep", "inline_limit", "lock_wait",
                                     "master_config_keys", "pull_min_files", "replicate",
                                     "rescan", "timeout", "topology"),
    ("runner multimaster", "status"): ("backup_keep", "inline_limit", "master_config_keys",
                                       "pull_min_files", "replicate", "rescan", "timeout",
                                       "topology"),
    ("runner multimaster", "restore"): ("timeout",),
    ("runner multimaster", "failback"): ("lock_wait",),
    ("runner multimaster", "add_peer"): ("timeout",),
    ("runner multimaster", "remove_peer"): ("timeout",),
    ("module multimaster", "minion_config_check"): tuple(minion_config.SETTINGS),
    ("module multimaster", "minion_config_apply"): tuple(minion_config.SETTINGS),
    ("state multimaster", "minion_config"): tuple(minion_config.SETTINGS),
}

CASES = [(kind, name) for kind in LOADER_MODULES
         for name in sorted(public_functions(_load(kind)))]


def test_every_loader_module_has_public_functions():
    kinds = {kind for kind, _ in CASES}
    assert kinds == set(LOADER_MODULES)
    assert len(CASES) >= 30, CASES


def _typo(names):
    """A misspelling of the first accepted argument (a letter dropped), or a made-up word."""
    for name in names:
        if len(name) > 3:
            return name[:-1], name
    return "tset", None


def _answered(mod, kind, fun, *args, **kwargs):
    """The named answer of ``fun`` (a return, or the execution module's SaltInvocationError)."""
    if kind == "module multimaster":
        with pytest.raises(SaltInvocationError) as exc:
            getattr(mod, fun)(*args, **kwargs)
        return str(exc.value)
    ret = getattr(mod, fun)(*args, **kwargs)
    assert isinstance(ret, dict) and ret["result"] is False, ret
    if kind.startswith("state"):
        assert ret["changes"] == {} and ret["name"] == (args[0] if args else ""), ret
        return ret["comment"]
    if kind.startswith("runner"):
        assert ret["retcode"] == 1, ret
    return ret["error"]


@pytest.mark.parametrize("kind, fun", CASES)
def test_a_misspelt_keyword_names_every_accepted_one(kind, fun):
    mod = _load(kind)
    func = getattr(mod, fun)
    module = LOADER_MODULES[kind][1]
    params = inspect.signature(func.guarded).parameters
    named = [p.name for p in params.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    accepted = sorted(set(named) | set(EXTRA.get((kind, fun), ())))
    # Salt sees **kwargs: it passes the keyword on instead of refusing or dropping it
    assert salt.utils.args.get_function_argspec(func).keywords in ("kwargs", "settings")
    typo, meant = _typo(named)
    assert typo not in accepted
    args = ["salt-master"] if kind.startswith("state") else []
    message = _answered(mod, kind, fun, *args, **{typo: "x", "__pub_user": "root"})
    suggestion = f": did you mean {meant}?" if meant else ""
    assert message == (f"{module}.{fun}: unknown argument {typo}{suggestion} "
                       f"(accepted: {', '.join(accepted) or 'none'})")
    # nothing ran: nothing to clean up, no retcode but the refusal's
    assert mod.__context__ in ({}, {"retcode": 1})


def test_the_arguments_a_signature_cannot_bind_are_named():
    def sync(peers=None, test=False):
        return peers, test

    def answer(fun, message, args, kwargs):
        return {"fun": fun, "error": message, "args": args, "kwargs": kwargs}

    wrapped = guard.public("multimaster", answer)(sync)
    assert wrapped("m2", test=True, __pub_jid="1") == ("m2", True)  # Salt's keys dropped
    assert wrapped("m2", "yes", "extra")["error"] == (
        "multimaster.sync: too many positional arguments (accepted: peers, test)")
    assert wrapped("m2", peers="m3")["error"] == (
        "multimaster.sync: multiple values for argument 'peers' (accepted: peers, test)")
    assert wrapped.__doc__ == sync.__doc__ and wrapped.__name__ == "sync"
    # Salt sets __jid__ (a runner's) in each function's globals: the module's
    assert wrapped.__globals__ is sync.__globals__ and wrapped.__module__ == sync.__module__

    def state(name, cmd=None, **kwargs):
        return name, cmd, kwargs

    wrapped = guard.public("multimaster", answer, ("delay",))(state)
    assert wrapped(cmd="x")["error"] == (
        "multimaster.state: missing a required argument: 'name' (accepted: cmd, delay, name)")
    # a function with **kwargs of its own gets Salt's keywords too, as before
    assert wrapped("n", delay=1, __pub_jid="1") == ("n", None, {"delay": 1, "__pub_jid": "1"})


# ----- malformed arguments of every type: a named error, never an exception ------
MALFORMED = ["", "x\x00y", "../../etc", "*", -1, 0, 2 ** 70, 1.5, float("nan"), True,
             [], [None, 1, "a"], {}, {"a": {"b": [1]}}, None]


@pytest.fixture
def sandboxed(tmp_path, monkeypatch):
    """Loader modules over a temp dir, nothing able to reach a daemon or restart anything."""
    import salt.client  # pylint: disable=import-outside-toplevel

    def no_daemon(*args, **kwargs):
        raise RuntimeError("no daemon in this test")

    monkeypatch.setattr(salt.client, "LocalClient", no_daemon)
    monkeypatch.setattr(rotation_steps, "CHECK_TRIES", 1)  # no daemon to wait for

    def load(kind):
        mod = _load(kind)
        mod.__opts__ = {"id": "m1", "test": False, "cachedir": str(tmp_path / "cache"),
                        "pki_dir": str(tmp_path / "pki"), "sock_dir": str(tmp_path / "sock"),
                        "conf_file": str(tmp_path / "etc" / "minion"),
                        "multimaster.master_config": str(tmp_path / "etc" / "master"),
                        "hash_type": "sha256", "multimaster": {"peers": ["m2"]}}
        mod.__salt__ = {"cmd.run_bg": no_daemon, "service.available": lambda name: False}
        return mod

    return load


def _named_or_result(kind, fun, call):
    """Run ``call``: a return (an error in it named), or the module's named Salt error."""
    try:
        ret = call()
    except Exception as exc:  # pylint: disable=broad-except
        from salt.exceptions import (  # pylint: disable=import-outside-toplevel
            CommandExecutionError)

        assert kind == "module multimaster" and isinstance(
            exc, (SaltInvocationError, CommandExecutionError)), f"{fun} raised {exc!r}"
        assert str(exc) and "Traceback" not in str(exc), str(exc)
        return None
    if isinstance(ret, dict) and ret.get("result") is False and "findings" not in ret:
        error = ret.get("error") or ret.get("comment")
        assert isinstance(error, str) and error and "Traceback" not in error, ret
    return ret


@pytest.mark.parametrize("kind, fun", CASES)
def test_malformed_arguments_of_every_type_get_a_named_error(kind, fun, sandboxed):
    mod = sandboxed(kind)
    func = getattr(mod, fun)
    params = [p for p in inspect.signature(func.guarded).parameters.values()
              if p.kind == p.POSITIONAL_OR_KEYWORD]
    for param in params:
        for value in MALFORMED:
            kwargs = {param.name: value}
            if kind.startswith("state") and param.name != "name":
                kwargs["name"] = "salt-master"
            if fun in ("sync", "restore", "rotate_key", "add_peer", "remove_peer", "apply",
                       "restart_minion", "restart_master", "minion_config_apply",
                       "master_key_apply", "key_event"):
                kwargs.setdefault("test", True)  # what would run anything, in test mode
            _named_or_result(kind, fun, lambda: func(**kwargs))
