"""[Note: quiet optional imports] in models/hf.py: the loggers of optional imports are held at
ERROR while a Hugging Face model is read, only where the user set no level, and restored."""

from __future__ import annotations

import logging

from wrapopt.models.hf import _IMPORT_LOGGERS, _quiet_optional_imports


def test_import_loggers_are_quiet_inside_and_restored_after():
    loggers = [logging.getLogger(n) for n in _IMPORT_LOGGERS]
    before = [lg.level for lg in loggers]
    loggers[1].setLevel(logging.DEBUG)  # the user's own level is theirs
    try:
        with _quiet_optional_imports():
            assert loggers[0].level == (logging.ERROR if before[0] == logging.NOTSET else before[0])
            assert loggers[1].level == logging.DEBUG
            assert not loggers[0].isEnabledFor(logging.WARNING) or before[0] not in (logging.NOTSET,)
        assert loggers[0].level == before[0] and loggers[1].level == logging.DEBUG
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)
