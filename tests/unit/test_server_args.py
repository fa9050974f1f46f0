"""ServerArgs validation: out-of-range flags fail at construction with a message naming the flag."""

from __future__ import annotations

import pytest

from engine.server_args import ServerArgs, ServerArgsError


@pytest.mark.parametrize("interval", [0, -1])
def test_decode_log_interval_below_one_is_refused(interval):
    # The scheduler logs every `decode_log_interval`-th decode batch (a modulo): 0 would divide
    # by zero at the first decode, deep inside a running server.
    with pytest.raises(ServerArgsError, match=r"--decode-log-interval must be >= 1, got " + str(interval)):
        ServerArgs(device="cpu", decode_log_interval=interval)


def test_decode_log_interval_of_one_is_accepted():
    assert ServerArgs(device="cpu", decode_log_interval=1).decode_log_interval == 1


def test_every_flag_has_help_text():
    import argparse
    import dataclasses

    missing = [f.name for f in dataclasses.fields(ServerArgs) if not (f.metadata or {}).get("help")]
    assert not missing, f"flags without --help text: {missing}"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert all(action.help for action in parser._actions)


def test_operational_timeouts_and_threads_are_flags():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--device", "cpu", "--health-check-timeout", "2.5", "--control-timeout", "7", "--startup-timeout", "30",
        "--dist-timeout", "40", "--req-waiting-timeout", "1.5", "--threads-per-rank", "1"]))
    assert (args.health_check_timeout, args.control_timeout, args.startup_timeout, args.dist_timeout,
            args.req_waiting_timeout, args.threads_per_rank) == (2.5, 7.0, 30.0, 40.0, 1.5, 1)


@pytest.mark.parametrize("field, value, message", [
    ("health_check_timeout", 0, "--health-check-timeout must be > 0"),
    ("control_timeout", -1, "--control-timeout must be > 0"),
    ("startup_timeout", 0, "--startup-timeout must be > 0"),
    ("dist_timeout", 0, "--dist-timeout must be > 0"),
    ("req_waiting_timeout", -1, "--req-waiting-timeout must be >= 0"),
    ("threads_per_rank", 0, "--threads-per-rank must be >= 1"),
])
def test_bad_timeouts_and_threads_are_refused(field, value, message):
    with pytest.raises(ServerArgsError, match=message):
        ServerArgs(device="cpu", **{field: value})


def test_pd_disaggregation_refuses_an_embedding_model():
    with pytest.raises(ServerArgsError, match="generative models only"):
        ServerArgs(device="cpu", is_embedding=True, disaggregation_mode="prefill")


def test_mixed_chunk_is_the_cpu_default_of_unified_servers_only():
    assert ServerArgs(model_path="m", device="cpu").enable_mixed_chunk
    assert not ServerArgs(model_path="m", device="cpu", disable_mixed_chunk=True).enable_mixed_chunk
    for mode in ("prefill", "decode"):
        assert not ServerArgs(model_path="m", device="cpu", disaggregation_mode=mode).enable_mixed_chunk

