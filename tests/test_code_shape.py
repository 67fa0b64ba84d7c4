"""The shape the architecture promises, checked on the tree: one home per rule, small units, one env reader."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVED = ("contracts", "stages", "orchestration")  # what runs in the app
DRIVERS = ("evidence", "training", "bench", "cli")  # what proves, trains, starts and measures it, from outside
PACKAGES = SERVED + DRIVERS
SOURCES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
# The import graph also covers scripts/ (one-off tools, drivers too); the size rules above do not.
PROJECT = (*PACKAGES, "scripts")
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 150, 60


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_package_sources_are_found():
    assert len(SOURCES) > 20 and all(path.suffix == ".py" for path in SOURCES)


# --- the import graph: every `import`/`from` of the project's own modules, at module level or inside a function -----
# Imports under `if TYPE_CHECKING:` are left out: they never run, so they close no circle (annotations only).


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for package in PROJECT for path in (ROOT / package).rglob("*.py")}


def _known(name: str) -> str | None:
    """The project module `name` loads: itself, else its longest known parent (`from a.b import c` with c a name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, tree: ast.Module | None = None):
    """(imported project module, line, inside a function) for each import in `module` that runs."""
    path = MODULES[module]
    tree = tree or ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    local = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(node)}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in type_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in names:
            target = _known(name) if name.split(".")[0] in PROJECT else None
            if target and target != module:
                yield target, node.lineno, id(node) in local


def import_graph(trees: dict[str, ast.Module] | None = None) -> dict[str, set[str]]:
    trees = trees or {}
    return {m: {target for target, _, _ in imports(m, trees.get(m))} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative): each holds an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_import_graph_sees_the_projects_modules():
    graph = import_graph()
    assert {"stages.scope", "evidence.golden", "training.shapes", "scripts.gpu_check"} <= set(graph)
    assert "stages.diffusion.self_check" in graph["stages.diffusion.stage"]  # relative `from .self_check import`
    assert "evidence.report" in graph["evidence.golden"]


def test_no_import_circle_among_the_projects_modules():
    assert cycles(import_graph()) == []


def test_an_import_circle_is_found():
    # The check can fail: contracts.sampling importing the module that imports it closes a circle.
    tree = ast.parse(MODULES["contracts.sampling"].read_text())
    tree.body.append(ast.parse("def f():\n    from contracts import provenance").body[0])
    assert any("contracts.sampling" in circle for circle in cycles(import_graph({"contracts.sampling": tree})))


#: Modules (or whole packages) that import the project's own modules inside functions, and why. Anywhere else an
#: import sits at the top of its module: a function-local one there would only hide a circle.
LOCAL_IMPORTS_ALLOWED = {
    "cli": "the command line: each subcommand imports what it runs, so `omniserve health` or `verify` starts without "
    "torch, Ray Serve or vLLM",
    "orchestration": "`orchestration.build_app` is resolved on first use (PEP 562), so the CLI imports the package "
    "without Ray Serve",
    "stages.diffusion.renderer": "the ingress imports the stage classes to bind them: torch, diffusers and the kernels "
    "load in a diffusion replica only",
    "stages.diffusion.self_audit": "the same: its control swaps the kernels (torch, the C++ build), which load in a "
    "diffusion replica only",
    "stages.scope": "the same: the kernels' module (torch, the C++ build) loads only where a configuration is described",
    "stages.kernels.vllm_cpu": "vLLM imports this plugin in every process it starts; the kernels (torch, the C++ "
    "build) load only where the LLM stage turned invariance on",
    "bench": "a benchmark loads what it measures (a stage: torch, vLLM; an app: Ray Serve) when it runs; every "
    "benchmark imports bench.load's helpers",
    "scripts": "one-off tools: each mode or section imports what it runs (scripts/gpu_check.py's sections on a GPU box)",
}


def allowed_local(module: str) -> bool:
    return any(module == key or module.startswith(key + ".") for key in LOCAL_IMPORTS_ALLOWED)


def local_imports(trees: dict[str, ast.Module] | None = None) -> list[str]:
    trees = trees or {}
    return [f"{m}:{line} imports {target}" for m in MODULES if not allowed_local(m)
            for target, line, local in imports(m, trees.get(m)) if local]


def test_no_function_local_import_of_the_projects_modules_outside_the_allow_list():
    assert local_imports() == []
    assert all(reason for reason in LOCAL_IMPORTS_ALLOWED.values())


def test_a_function_local_import_is_found():
    tree = ast.parse(MODULES["stages.llm.stage"].read_text())
    tree.body.append(ast.parse("def f():\n    from stages.scope import llm_scope").body[0])
    assert any(found.startswith("stages.llm.stage:") for found in local_imports({"stages.llm.stage": tree}))


def drivers_imported_by_served(trees: dict[str, ast.Module] | None = None) -> list[str]:
    driver, graph = (*DRIVERS, "scripts"), import_graph(trees)  # the graph once: each module parsed once
    return [f"{m} imports {target}" for m in MODULES if m.split(".")[0] in SERVED
            for target in graph[m] if target.split(".")[0] in driver]


def test_the_served_packages_import_no_driver():
    # Drivers import the served packages, never the reverse: a replica never loads an audit, a recorder, training,
    # a benchmark or the CLI.
    assert drivers_imported_by_served() == []


def test_a_served_module_importing_a_driver_is_found():
    tree = ast.parse(MODULES["stages.scope"].read_text())
    tree.body.append(ast.parse("def f():\n    import evidence.report").body[0])
    assert drivers_imported_by_served({"stages.scope": tree}) == ["stages.scope imports evidence.report"]


# --- methods where they belong: a module function whose first parameter is an instance of a class of its own file is
# that class's method pushed out (to dodge a line bound, or by habit); in the served packages there is none.


def _instance_of(annotation: ast.expr | None) -> str | None:
    """The class an annotation says an argument is an instance of: `X`, `"X"`, `X | None` (not a list of X, nor a
    union with another type)."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _instance_of(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = [annotation.left, annotation.right]
        if any(isinstance(side, ast.Constant) and side.value is None for side in sides):
            return next(_instance_of(side) for side in sides if not isinstance(side, ast.Constant))
    return None


def methods_outside(tree: ast.Module, path: str) -> list[str]:
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    return [
        f"{path}:{node.lineno} {node.name}({node.args.args[0].arg}: {_instance_of(node.args.args[0].annotation)})"
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.args.args
        and _instance_of(node.args.args[0].annotation) in classes
    ]


def test_no_served_module_function_takes_an_instance_of_its_own_files_class_first():
    served = [path for path in SOURCES if relative(path).split("/")[0] in SERVED]
    assert [found for path in served for found in methods_outside(ast.parse(path.read_text()), relative(path))] == []


def test_a_method_pushed_out_of_its_class_is_found():
    tree = ast.parse(
        "class Plan:\n    pass\n"
        "def results(plan: Plan): ...\n"
        "def maybe(plan: 'Plan | None'): ...\n"
        "def many(plans: list[Plan]): ...\n"
        "def either(plan: Plan | str): ...\n"
    )
    assert methods_outside(tree, "m.py") == ["m.py:3 results(plan: Plan)", "m.py:4 maybe(plan: Plan)"]


def units(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


#: Classes that are one concept longer than MAX_CLASS_LINES, each with its own bound and why (a bound, not a target).
ONE_CONCEPT_CLASSES = {
    # The step engine's one loop, read top to bottom (STYLE.md): submit and cancel, join (a moved sample resumed),
    # pick, forward (a sample's checkpoint handed over), partials, finish, and the hand-off of every sample when its
    # replica stops. Splitting it would hide the order of a step.
    "stages/diffusion/engine/engine.py:StepEngine": 185,
}


def class_bound(path: Path, node: ast.AST) -> int:
    if not isinstance(node, ast.ClassDef):
        return MAX_FUNCTION_LINES
    return ONE_CONCEPT_CLASSES.get(f"{relative(path)}:{node.name}", MAX_CLASS_LINES)


def test_no_class_over_150_lines_but_the_named_concepts_and_no_function_over_60():
    too_long = [
        f"{relative(path)}:{node.lineno} {node.name} ({lines} lines)"
        for path in SOURCES
        for node, lines in units(path)
        if lines > class_bound(path, node)
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


def test_ray_serves_private_state_is_read_in_one_adapter_only():
    private = r"ray\.(serve\.)?_private|_replica_impl|_shutting_down"
    found = {relative(path) for path in SOURCES if re.search(private, path.read_text())}
    assert found == {"stages/serve_replica.py"}


def test_vllms_private_names_are_read_in_one_adapter_only():
    found = {relative(path) for path in SOURCES if re.search(r"_batch_invariant_(LIB|MODE)\b", path.read_text())}
    assert found == {"stages/kernels/vllm_mode.py"}


def test_diffusers_private_names_are_read_in_one_adapter_only():
    private = (r"\._(get_add_time_ids|unpack_latents|pack_latents|prepare_latent_image_ids|encode_vae_image"
               r"|keep_in_fp32_modules)\b|_get_qkv_projections|_internal_dict|vars\([^)]*scheduler")
    found = {relative(path) for path in SOURCES if re.search(private, path.read_text())}
    assert found == {"stages/diffusers_private.py"}
