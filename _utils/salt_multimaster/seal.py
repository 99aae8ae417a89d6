"""
Seal secrets to one receiver's RSA public key.

A sealed blob is ``RSA-OAEP(SHA-256)`` around a random 256-bit AES-GCM key;
the receiver's minion id and the purpose are bound as associated data, so a
blob sealed for one peer or one file cannot be replayed as another.  Only
the sealed blob travels on Salt's publish channel: every minion receives the
publish, only the receiving peer can open it.
"""

import base64
import functools
import json
import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = 1


class SealError(ValueError):
    """A blob that cannot be opened (wrong key, tampered, wrong purpose)."""


def _oaep():
    return padding.OAEP(
        mgf=padding.MGF1(algorithm=hashes.SHA256()),
        algorithm=hashes.SHA256(),
        label=None,
    )


def _aad(receiver, purpose):
    return json.dumps([VERSION, receiver, purpose]).encode()


BINARY_MAGIC = b"mmseal1b"


@functools.lru_cache(maxsize=4)
def _private_key(private_pem):
    """
    The loaded private key, once per process: an apply opens one blob per
    sealed item.  The key is the receiver's own (its minion key on its
    disk), so OpenSSL's consistency check of it is skipped: 39 ms per load
    of a 2048-bit key, against 0.2 ms without.
    """
    return serialization.load_pem_private_key(private_pem, password=None,
                                              unsafe_skip_rsa_key_validation=True)


def seal(public_pem, data, receiver, purpose, binary=False):
    """
    Return a text blob that only the holder of the private key opens; with
    ``binary``, bytes (no base64: for bulk replies, which msgpack carries as
    they are).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if isinstance(public_pem, str):
        public_pem = public_pem.encode()
    pub = serialization.load_pem_public_key(public_pem)
    key = AESGCM.generate_key(bit_length=256)
    nonce = os.urandom(12)
    ct = AESGCM(key).encrypt(nonce, data, _aad(receiver, purpose))
    wrapped = pub.encrypt(key, _oaep())
    if binary:
        return BINARY_MAGIC + wrapped + nonce + ct
    return "mmseal1:" + ".".join(
        base64.b64encode(x).decode() for x in (wrapped, nonce, ct)
    )


def unseal(private_pem, blob, receiver, purpose):
    """Open a blob from :func:`seal`; raise :class:`SealError` on any mismatch."""
    if isinstance(blob, str) and blob.startswith(BINARY_MAGIC.decode()):
        # Salt's msgpack layer hands valid UTF-8 bytes back as str
        blob = blob.encode("utf-8", "surrogateescape")
    binary = isinstance(blob, bytes) and blob.startswith(BINARY_MAGIC)
    if not binary and (not isinstance(blob, str) or not blob.startswith("mmseal1:")):
        raise SealError("not a sealed blob")
    if isinstance(private_pem, str):
        private_pem = private_pem.encode()
    try:
        priv = _private_key(private_pem)
        if binary:
            # slices of a memoryview: no copy of a bulk reply (tens of MiB)
            size = priv.key_size // 8
            body = memoryview(blob)[len(BINARY_MAGIC):]
            wrapped, nonce, ct = bytes(body[:size]), bytes(body[size:size + 12]), body[size + 12:]
        else:
            wrapped, nonce, ct = (base64.b64decode(x) for x in blob[8:].split("."))
        key = priv.decrypt(wrapped, _oaep())
        return AESGCM(key).decrypt(nonce, ct, _aad(receiver, purpose))
    except Exception as exc:  # pylint: disable=broad-except
        raise SealError(f"cannot open sealed {purpose}: {exc.__class__.__name__}") from None
