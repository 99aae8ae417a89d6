"""The master fingerprint (salt_multimaster.finger): both of Salt's forms."""

import hashlib

import salt.utils.crypt
import salt.version
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from salt_multimaster import finger


def _pub():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def _salt_key_finger(path, sum_type):
    """What the installed salt-key -F computes for a local key file (salt.key.Key.finger)."""
    if salt.version.__version_info__[0] >= 3008:
        return salt.utils.crypt.pem_finger(key=path.read_bytes(), sum_type=sum_type)
    return salt.utils.crypt.pem_finger(str(path), sum_type=sum_type)


def test_forms(tmp_path):
    pub = _pub()
    path = tmp_path / "master.pub"
    path.write_text(pub)
    for sum_type in ("sha256", "md5", "sha512"):
        # Salt 3006/3007 salt-key -F and every minion's master_finger check
        assert finger.body_finger(pub, sum_type) == salt.utils.crypt.pem_finger(
            str(path), sum_type=sum_type
        )
        # Salt 3008.0-3008.5 salt-key -F: the whole PEM text
        digest = getattr(hashlib, sum_type)(pub.encode()).hexdigest()
        assert finger.normalize(finger.text_finger(pub, sum_type)) == digest
        # the installed Salt's salt-key -F
        assert finger.master_finger(pub, sum_type) == _salt_key_finger(path, sum_type)
        assert finger.file_finger(str(path), sum_type) == _salt_key_finger(path, sum_type)
    assert finger.body_finger(pub) != finger.text_finger(pub)
    if (3008, 0) <= tuple(salt.version.__version_info__[:2]) <= (3008, 5):
        assert finger.master_finger(pub) == finger.text_finger(pub)
    if salt.version.__version_info__[0] < 3008:
        assert finger.master_finger(pub) == finger.body_finger(pub)
    assert finger.master_finger("") == "" and finger.file_finger(str(tmp_path / "no")) == ""


def test_matches_either_form():
    pub, other = _pub(), _pub()
    for form in (finger.body_finger, finger.text_finger):
        for sum_type in ("sha256", "sha1", "md5", "sha512"):
            assert finger.matches(pub, form(pub, sum_type))
            assert finger.matches(pub.replace("\n", "\r\n"), form(pub, sum_type).upper())
            assert not finger.matches(other, form(pub, sum_type))
    assert not finger.matches(pub, "ab:cd") and not finger.matches("", finger.body_finger(pub))
    assert finger.valid(finger.text_finger(pub)) and not finger.valid("zz:11")
    assert not finger.valid("") and not finger.valid(None)


def test_sum_type():
    pub = _pub()
    for sum_type in ("md5", "sha1", "sha224", "sha256", "sha384", "sha512"):
        assert finger.sum_type(finger.body_finger(pub, sum_type)) == sum_type
    assert finger.sum_type("ab:cd") is None and finger.sum_type(None) is None
