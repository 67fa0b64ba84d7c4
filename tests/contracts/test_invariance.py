"""The tri-state switch and the seed contract, rule by rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.invariance import (
    MAX_SEED,
    MIN_SEED,
    SeedContractError,
    resolve_batch_invariant,
    validate_seed_contract,
)
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams

OWN = {"llm": "OMNI_LLM_BATCH_INVARIANT", "diffusion": "OMNI_DIFFUSION_BATCH_INVARIANT"}
GLOBAL = "VLLM_BATCH_INVARIANT"


def test_seed_range_is_what_torch_manual_seed_accepts():
    torch = pytest.importorskip("torch")
    assert (MIN_SEED, MAX_SEED) == (-(2**63), 2**64 - 1)
    torch.Generator().manual_seed(MIN_SEED)
    torch.Generator().manual_seed(MAX_SEED)
    for outside in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises((RuntimeError, ValueError, OverflowError)):
            torch.Generator().manual_seed(outside)


# (override, own stage variable, global variable) -> expected. None: not set.
TRI_STATE_TABLE = [
    (None, None, None, False),  # both unset: off, exactly as without the feature
    (None, None, "1", True),  # unset follows the global switch
    (None, None, "0", False),
    (None, "1", None, True),  # the stage's own variable alone
    (None, "0", None, False),
    (None, "1", "0", True),  # own variable overrides the global, both directions
    (None, "0", "1", False),
    (None, "1", "1", True),
    (None, "0", "0", False),
    (True, None, None, True),  # an explicit override (app config) wins over everything
    (False, None, "1", False),
    (False, "1", "1", False),
    (True, "0", "0", True),
]


@pytest.mark.parametrize("stage", ["llm", "diffusion"])
@pytest.mark.parametrize("override,own,global_,expected", TRI_STATE_TABLE)
def test_switch_tri_state_table(stage, override, own, global_, expected):
    environ = {}
    if own is not None:
        environ[OWN[stage]] = own
    if global_ is not None:
        environ[GLOBAL] = global_
    assert resolve_batch_invariant(stage, environ=environ, override=override) is expected


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " yes ", "On", "\ttrue\n"])
def test_switch_true_spellings_are_stripped_and_case_insensitive(raw):
    assert resolve_batch_invariant("diffusion", environ={OWN["diffusion"]: raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", " no ", "OFF"])
def test_switch_false_spellings_are_stripped_and_case_insensitive(raw):
    assert resolve_batch_invariant("diffusion", environ={OWN["diffusion"]: raw}) is False


@pytest.mark.parametrize("name", [OWN["llm"], OWN["diffusion"]])
@pytest.mark.parametrize("raw", ["", "  ", "2", "enable", "truee", "y"])
def test_switch_invalid_value_raises_naming_variable_and_value(name, raw):
    with pytest.raises(ValueError) as err:
        resolve_batch_invariant("llm" if "LLM" in name else "diffusion", environ={name: raw})
    assert name in str(err.value) and repr(raw) in str(err.value)


# What vLLM itself makes of its variable: the switch must agree, and refuse what vLLM refuses.
VLLM_VALUES = ["0", "1", "2", "-1", " 1 ", "01", "+0", "1_0", "true", "on", "yes", "", "  ", "1.0", "0x1"]


def _vllm_reads(value: str):
    import os

    from vllm import envs as vllm_envs

    before = os.environ.get(GLOBAL)
    os.environ[GLOBAL] = value
    try:
        return vllm_envs.environment_variables[GLOBAL]()
    except ValueError:
        return ValueError
    finally:
        if before is None:
            os.environ.pop(GLOBAL)
        else:
            os.environ[GLOBAL] = before


@pytest.mark.parametrize("raw", VLLM_VALUES)
def test_global_switch_is_parsed_exactly_as_vllm_parses_it(raw):
    pytest.importorskip("vllm")
    expected = _vllm_reads(raw)
    if expected is ValueError:
        with pytest.raises(ValueError) as err:
            resolve_batch_invariant("llm", environ={GLOBAL: raw})
        assert GLOBAL in str(err.value) and repr(raw) in str(err.value)
    else:
        assert resolve_batch_invariant("llm", environ={GLOBAL: raw}) is expected


def test_switch_stages_are_independent():
    environ = {OWN["llm"]: "1", OWN["diffusion"]: "0", GLOBAL: "1"}
    assert resolve_batch_invariant("llm", environ=environ) is True
    assert resolve_batch_invariant("diffusion", environ=environ) is False
    environ = {OWN["llm"]: "0", OWN["diffusion"]: "1"}
    assert resolve_batch_invariant("llm", environ=environ) is False
    assert resolve_batch_invariant("diffusion", environ=environ) is True


def test_switch_other_stage_variable_is_ignored():
    assert resolve_batch_invariant("llm", environ={OWN["diffusion"]: "1"}) is False


@pytest.mark.parametrize("stage", ["", "LLM", "vae", "audio"])
def test_switch_unknown_stage_raises_value_error(stage):
    with pytest.raises(ValueError, match="unknown stage"):
        resolve_batch_invariant(stage, environ={})


def test_switch_override_must_be_bool_or_none():
    with pytest.raises(TypeError):
        resolve_batch_invariant("llm", environ={}, override=1)


def test_switch_reads_process_environment_by_default(monkeypatch):
    monkeypatch.delenv(OWN["diffusion"], raising=False)
    monkeypatch.setenv(GLOBAL, "1")
    assert resolve_batch_invariant("diffusion") is True
    monkeypatch.setenv(OWN["diffusion"], "off")
    assert resolve_batch_invariant("diffusion") is False


# --- the seed contract -------------------------------------------------------


def test_seed_contract_off_accepts_anything_the_model_accepts():
    params = DiffusionSamplingParams(generator_device="cuda", latents=[[0.0]], sigmas=[1.0])
    validate_seed_contract(params, batch_invariant=False)
    validate_seed_contract(DiffusionSamplingParams(), batch_invariant=False)


def test_seed_contract_on_requires_a_seed():
    with pytest.raises(SeedContractError, match="seed is required") as err:
        validate_seed_contract(DiffusionSamplingParams(), batch_invariant=True)
    assert err.value.param == "seed"
    assert isinstance(err.value, ValueError)


@given(st.integers(min_value=MIN_SEED, max_value=MAX_SEED))
def test_seed_contract_on_accepts_every_seed_in_range(seed):
    validate_seed_contract(DiffusionSamplingParams(seed=seed), batch_invariant=True)


@given(st.one_of(st.integers(max_value=MIN_SEED - 1), st.integers(min_value=MAX_SEED + 1)))
def test_seed_contract_on_refuses_every_seed_out_of_range(seed):
    # Plain mappings reach the contract unvalidated (the model itself refuses these too).
    with pytest.raises(SeedContractError, match="seed must be an integer"):
        validate_seed_contract({"seed": seed}, batch_invariant=True)


@pytest.mark.parametrize("seed", [True, False, 1.0, "1"])
def test_seed_contract_on_refuses_non_integer_seeds(seed):
    with pytest.raises(SeedContractError):
        validate_seed_contract({"seed": seed}, batch_invariant=True)


@pytest.mark.parametrize(
    "field,value",
    [("generator_device", "cpu"), ("latents", [[0.5]]), ("sigmas", [1.0, 0.0])],
)
def test_seed_contract_on_refuses_inputs_that_bypass_the_seed(field, value):
    params = DiffusionSamplingParams(seed=7, **{field: value})
    with pytest.raises(SeedContractError, match=field) as err:
        validate_seed_contract(params, batch_invariant=True)
    assert err.value.param == field


def test_seed_contract_lists_every_violation_in_one_message():
    params = DiffusionSamplingParams(generator_device="cpu", latents=[[0.5]], sigmas=[1.0])
    with pytest.raises(SeedContractError) as err:
        validate_seed_contract(params, batch_invariant=True)
    message = str(err.value)
    for word in ("seed is required", "generator_device", "latents", "sigmas"):
        assert word in message
    assert len(err.value.violations) == 4


def test_seed_contract_refuses_a_generator_in_a_mapping():
    with pytest.raises(SeedContractError, match="pass seed"):
        validate_seed_contract({"seed": 1, "generator": object()}, batch_invariant=True)


def test_seed_contract_greedy_llm_needs_no_seed_but_sampling_does():
    validate_seed_contract(LLMSamplingParams(temperature=0.0), batch_invariant=True)
    with pytest.raises(SeedContractError, match="seed is required"):
        validate_seed_contract(LLMSamplingParams(temperature=0.7), batch_invariant=True)
    validate_seed_contract(LLMSamplingParams(temperature=0.7, seed=3), batch_invariant=True)


def test_seed_contract_error_survives_pickling_across_processes():
    import pickle

    import cloudpickle

    err = SeedContractError(["seed is required: pass an integer seed", "latents is not allowed"], param="seed")
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        again = loads(dumps(err))
        assert str(again) == str(err) and again.violations == err.violations and again.param == "seed"
