"""The shape the architecture promises, checked on the tree: one home per rule, small units, one env reader."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVED = ("contracts", "stages", "orchestration")  # what runs in the app
DRIVERS = ("bench", "cli")  # what starts and measures it, from outside
PACKAGES = SERVED + DRIVERS
SOURCES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 150, 60


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_package_sources_are_found():
    assert len(SOURCES) > 20 and all(path.suffix == ".py" for path in SOURCES)


def test_the_served_packages_import_no_driver():
    # Drivers import the served packages, never the reverse: a replica never loads a benchmark or the CLI.
    found = [f"{relative(path)}:{number}" for path in SOURCES if path.parts[len(ROOT.parts)] in SERVED
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.match(r"\s*(from|import)\s+(bench|cli)\b", line)]
    assert not found, found


def units(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_class_over_150_lines_and_no_function_over_60():
    too_long = [
        f"{relative(path)}:{node.lineno} {node.name} ({lines} lines)"
        for path in SOURCES
        for node, lines in units(path)
        if lines > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES)
    ]
    assert not too_long, too_long


def test_the_environment_is_touched_in_one_module_only():
    readers = [relative(p) for p in SOURCES if re.search(r"\bos\.(environ|getenv|putenv|unsetenv)\b", p.read_text())]
    assert readers == ["contracts/envs.py"]


def occurrences(pattern: str) -> list[str]:
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{relative(path)}:{number}")
    return found


ONE_DEFINITION = {
    "the prompt-length limit": r"^MAX_PROMPT_CHARS\s*=",
    "the pixel limit": r"^\s+max_pixels\s*:",
    "the step limit (contract)": r"^MAX_INFERENCE_STEPS\s*=",
    "the step limit (serving)": r"^\s+max_inference_steps\s*:",
    "the seed range (low)": r"^MIN_SEED\s*=",
    "the seed range (high)": r"^MAX_SEED\s*=",
    "the seed picker": r"^def pick_seed\b",
    "a seed picked by the server": r"(?<!def )\bpick_seed\(\)",
    "the seed -> generator rule": r"\.manual_seed\(params\.seed\)",
    "a random seed drawn": r"\brandbits\(",
    "the switch parser": r"^def parse_switch\b",
    "vLLM's switch parser": r"^def parse_vllm_bool\b",
    "the switch resolution": r"^def resolve_batch_invariant\b",
    "the seed contract": r"^def validate_seed_contract\b",
    "the pydantic-error-to-field mapping": r"^def describe_validation_error\b",
    "the atomic cache builder": r"\bmkdtemp\(",
    "embedded id omniserve/tiny-sd-unet": r"[\"']omniserve/tiny-sd-unet[\"']",
    "embedded id omniserve/tiny-sd3-dit": r"[\"']omniserve/tiny-sd3-dit[\"']",
    "embedded id omniserve/tiny-shapes-sd": r"[\"']omniserve/tiny-shapes-sd[\"']",
    "embedded id embedded:tiny-llama": r"[\"']embedded:tiny-llama[\"']",
    "embedded id embedded:tiny-rewriter": r"[\"']embedded:tiny-rewriter[\"']",
    "embedded id embedded:wide-llama": r"[\"']embedded:wide-llama[\"']",
}


@pytest.mark.parametrize("rule", ONE_DEFINITION)
def test_each_rule_has_exactly_one_home(rule):
    found = occurrences(ONE_DEFINITION[rule])
    assert len(found) == 1, f"{rule}: {found}"


def test_vllms_private_names_are_read_in_one_adapter_only():
    found = {relative(path) for path in SOURCES if re.search(r"_batch_invariant_(LIB|MODE)\b", path.read_text())}
    assert found == {"stages/kernels/vllm_mode.py"}
