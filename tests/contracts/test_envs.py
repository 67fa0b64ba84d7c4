"""The environment table (contracts.envs): the one module that reads the environment."""

import os
from pathlib import Path

import pytest

from contracts import envs


def test_every_variable_has_a_meaning_and_a_parser():
    for name, variable in envs.VARIABLES.items():
        assert variable.name == name and variable.meaning and callable(variable.parse)


def test_reading_a_variable_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="environment table"):
        envs.read("HOME")


def test_defaults_apply_when_unset_and_values_parse_when_set():
    assert envs.read("CXX", {}) == "c++" and envs.read("CXX", {"CXX": "g++"}) == "g++"
    assert envs.read("VLLM_CPU_ATTN_SPLIT_KV", {}) is True and envs.read("VLLM_CPU_ATTN_SPLIT_KV", {"VLLM_CPU_ATTN_SPLIT_KV": "0"}) is False
    assert envs.read("OMNI_LLM_BATCH_INVARIANT", {}) is None


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path / "explicit"))
    assert envs.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("OMNISERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_root() == tmp_path / "xdg" / "omniserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.cache_root() == Path(os.path.expanduser("~")) / ".cache" / "omniserve"


def test_overriding_restores_the_environment_exactly(monkeypatch):
    monkeypatch.setenv("OMNISERVE_TEST_KEEP", "before")
    monkeypatch.delenv("OMNISERVE_TEST_NEW", raising=False)
    with envs.overriding({"OMNISERVE_TEST_KEEP": "during", "OMNISERVE_TEST_NEW": "x"}):
        assert os.environ["OMNISERVE_TEST_KEEP"] == "during" and os.environ["OMNISERVE_TEST_NEW"] == "x"
    assert os.environ["OMNISERVE_TEST_KEEP"] == "before" and "OMNISERVE_TEST_NEW" not in os.environ


def test_assign_returns_the_previous_value_for_an_exact_restore(monkeypatch):
    monkeypatch.delenv("OMNISERVE_TEST_NEW", raising=False)
    assert envs.assign("OMNISERVE_TEST_NEW", "1") is None and os.environ["OMNISERVE_TEST_NEW"] == "1"
    assert envs.assign("OMNISERVE_TEST_NEW", None) == "1" and "OMNISERVE_TEST_NEW" not in os.environ


def test_the_packed_weights_bound_is_half_the_memory_the_process_may_use_unless_given(monkeypatch):
    """A model larger than a fixed bound had its weights packed again at every forward (measured: 40 layers of
    4096x4096 float32 under the old 2 GiB default, 5.3 s a forward against 0.12 s kept: docs/performance/price-of-stock.md)."""
    assert envs.read("OMNISERVE_PACKED_WEIGHTS_MB", {}) == envs.memory_bytes() // 2 >> 20
    assert envs.read("OMNISERVE_PACKED_WEIGHTS_MB", {"OMNISERVE_PACKED_WEIGHTS_MB": "512"}) == 512
    with pytest.raises(ValueError, match="whole number of MiB"):
        envs.read("OMNISERVE_PACKED_WEIGHTS_MB", {"OMNISERVE_PACKED_WEIGHTS_MB": "lots"})
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    real_open = open

    def cgroup(limit: str):  # a container limited to `limit` bytes (cgroup v2's file)
        def fake_open(path, *args, **kwargs):
            if str(path) == "/sys/fs/cgroup/memory.max":
                from io import StringIO

                return StringIO(limit)
            return real_open(path, *args, **kwargs)

        return fake_open

    monkeypatch.setattr("builtins.open", cgroup(f"{1 << 30}\n"))
    assert envs.memory_bytes() == min(physical, 1 << 30)
    monkeypatch.setattr("builtins.open", cgroup("max\n"))  # no limit: the machine's memory
    assert envs.memory_bytes() <= physical


def test_an_unheld_environment_carries_no_paths_variables_and_keeps_the_rest(monkeypatch):
    from contracts.cpu import unheld_environment

    for name, value in envs.cpu_isa_limits("avx2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMNISERVE_CPU_ISA", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")  # the generic path's
    monkeypatch.setenv("OMNISERVE_SOMETHING_ELSE", "kept")
    environ = unheld_environment()
    held = {*envs.cpu_isa_limits("avx2"), *envs.cpu_isa_limits("generic"), "OMNISERVE_CPU_ISA"}
    assert not held & set(environ) and environ["OMNISERVE_SOMETHING_ELSE"] == "kept"
