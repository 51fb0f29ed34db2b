"""quiet.py: exactly the known third-party noise is dropped, nothing else of those loggers."""

import logging

from lora_lab.quiet import KNOWN_NOISE, install_log_filters


def test_known_noise_is_dropped_and_everything_else_kept(caplog):
    install_log_filters()
    install_log_filters()  # idempotent: one filter per entry
    caplog.set_level(logging.DEBUG)
    for name, start, also, _ in KNOWN_NOISE:
        logger = logging.getLogger(name)
        assert sum(f.start == start and f.also == also for f in logger.filters if hasattr(f, "also")) == 1
        logger.warning("%s something %s", start, also)  # the known line: dropped
        logger.warning("a real problem: %s", name)  # anything else: kept
    kept = [r.getMessage() for r in caplog.records]
    assert kept == [f"a real problem: {name}" for name, *_ in KNOWN_NOISE]


def test_the_torchao_filter_keeps_other_load_failures(caplog):
    install_log_filters()
    caplog.set_level(logging.WARNING)
    logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: no")
    logging.getLogger("torchao").warning("Failed to load config file")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load config file"]
