"""
The ``multimaster_progress`` outputter prints one line per progress event,
found by Salt's loader through the extension's ``salt.loader`` entry point dirs.
"""

import salt.config
import salt.loader

from salt_multimaster import loader as mm_loader


def _outputters(tmp_path):
    opts = salt.config.master_config(None)
    opts.update(cachedir=str(tmp_path), extension_modules=str(tmp_path / "extmods"),
                outputter_dirs=mm_loader.loader_dirs()["output"])
    return salt.loader.outputters(opts)


def test_the_outputter_is_found_through_the_loader_dirs(tmp_path):
    assert "multimaster_progress" in _outputters(tmp_path)


def test_a_progress_event_prints_its_message_only(tmp_path):
    out = _outputters(tmp_path)["multimaster_progress"]
    event = {"suffix": "progress",
             "event": {"message": "master02: apply 120/3000", "outputter": "multimaster_progress",
                       "_stamp": "2026-11-24T01:00:00"}}
    assert out(event) == "master02: apply 120/3000"


def test_data_without_a_message_is_still_shown(tmp_path):
    out = _outputters(tmp_path)["multimaster_progress"]
    assert out({"suffix": "progress", "event": {"other": 1}}) == str(
        {"suffix": "progress", "event": {"other": 1}})
