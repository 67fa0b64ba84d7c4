"""docs/architecture.md names real code: every dotted name of the project's packages it cites in backticks resolves."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("contracts", "stages", "orchestration", "cli", "bench", "examples")
CITED = re.compile(r"`((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)`")


def cited_names(text: str) -> list[str]:
    return sorted(set(CITED.findall(text)))


def resolve(name: str) -> object:
    """The object `name` names: its longest importable module prefix, then attributes. A Serve deployment stands
    for its class (`@serve.deployment` wraps it), so `stages.diffusion.stage.DiffusionStage.render` resolves."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise  # a module that exists failed to import: not a wrong name in the doc
            continue
        break
    else:
        raise ModuleNotFoundError(f"no module of {name!r} imports")
    for attribute in parts[cut:]:
        found = getattr(getattr(found, "func_or_class", found), attribute)
    return found


def test_the_architecture_page_cites_names_of_each_kind():
    names = cited_names(DOC.read_text())
    assert len(names) > 50, names
    assert {name.split(".")[0] for name in names} >= {"contracts", "stages", "orchestration", "examples"}


def test_every_dotted_name_the_architecture_page_cites_resolves():
    unresolved = []
    for name in cited_names(DOC.read_text()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            unresolved.append(f"{name}: {exc!r}")
    assert not unresolved, unresolved


@pytest.mark.parametrize(
    "wrong",
    [
        "orchestration.pipeline.ImagePipeline.imagez",
        "stages.diffusion.stage.DiffusionStage.generate",
        "orchestration.nowhere.Thing",
    ],
)
def test_a_wrong_name_does_not_resolve(wrong):
    with pytest.raises((ImportError, AttributeError)):
        resolve(wrong)
