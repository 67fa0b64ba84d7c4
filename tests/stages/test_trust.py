"""The user cache is trusted only when this user owns it and nobody else can write to it (stages.trust).

Checked on the two things loaded from it: the compiled kernel library (also its sha256 against its build
record) and the embedded models' directories.
"""

import json
import os

import pytest

from stages import embedded
from stages.kernels import native
from stages.trust import UntrustedCacheError, distrust

OTHER_UID = 54321


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    return tmp_path


def test_a_private_file_is_trusted_and_a_shared_or_foreign_or_linked_one_is_not(tmp_path):
    private = tmp_path / "private"
    private.write_text("x")
    private.chmod(0o644)
    assert distrust(private) is None
    private.chmod(0o666)
    assert "writable by its group or by others" in distrust(private)
    link = tmp_path / "link"
    link.symlink_to(private)
    assert "symbolic link" in distrust(link)
    if os.getuid() == 0:  # only root can give a file away
        foreign = tmp_path / "foreign"
        foreign.write_text("x")
        os.chown(foreign, OTHER_UID, -1)
        assert f"uid {OTHER_UID}" in distrust(foreign)


def fake_library(cache) -> "os.PathLike":
    path = native.library_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF a library")
    native._record(path).write_text(native._sha256(path) + "\n")
    return path


def test_the_kernel_library_is_used_only_when_trusted_and_intact(cache):
    path = fake_library(cache)
    assert native._why_not_use(path) is None
    path.write_bytes(b"\x7fELF another library")
    assert "differs from what its build recorded" in native._why_not_use(path)
    native._record(path).write_text(native._sha256(path) + "\n")
    path.chmod(0o777)
    assert "writable" in native._why_not_use(path)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_tampered_kernel_library_of_another_user_is_refused_not_loaded(cache):
    path = fake_library(cache)
    path.write_bytes(b"\x7fELF tampered")
    os.chown(path, OTHER_UID, -1)
    os.chown(path.parent, OTHER_UID, -1)
    with pytest.raises(native.KernelBuildError, match="refusing the cached kernel library"):
        native.build()


def built_model(cache, calls):
    def build(directory):
        calls.append(directory)
        (directory / "weights").write_text("w")
        return {"built": len(calls)}

    return embedded.build_cached(cache / "model", build)


def test_a_cached_model_writable_by_others_is_rebuilt(cache):
    calls = []
    target = built_model(cache, calls)
    assert built_model(cache, calls) == target and len(calls) == 1  # trusted: reused
    target.chmod(0o777)
    built_model(cache, calls)
    assert len(calls) == 2 and distrust(target) is None
    assert json.loads((target / embedded.MARKER).read_text()) == {"built": 2}


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_cached_model_of_another_user_is_refused(cache):
    target = built_model(cache, [])
    os.chown(target, OTHER_UID, -1)
    with pytest.raises(UntrustedCacheError, match=f"uid {OTHER_UID}"):
        built_model(cache, [])
