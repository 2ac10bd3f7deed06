"""tests/buildcache.py's reuse of a compiled op across clean clones: the recorded inputs' mtimes come back
only for bytes that are unchanged, and nothing is recorded for a build older than its inputs."""

from __future__ import annotations

import os
from pathlib import Path

import buildcache

NS = 1_000_000_000


def fake_build(tmp_path: Path, built_at_ns: int) -> tuple[Path, Path, Path]:
    """An extension folder with one build (as torch writes it) over a source tree, its log saying when."""
    src = tmp_path / "venv" / "csrc"
    (src / "include").mkdir(parents=True)
    (src / "op.cpp").write_text("int f() { return 1; }\n")
    (src / "include" / "op.h").write_text("int f();\n")
    ext = tmp_path / "extensions"
    build = ext / "op"
    build.mkdir(parents=True)
    (build / "build.ninja").write_text(
        f"cflags = -DX -I{src}/include -isystem /usr/include -O2\n"
        f"build op.o: compile {src}/op.cpp\n\nbuild op.so: link op.o\n")
    (build / ".ninja_log").write_text(
        "# ninja log v5\n"
        f"0\t10\t{built_at_ns}\top.o\tabc\n10\t20\t{built_at_ns}\top.so\tdef\n")
    for p in (src / "op.cpp", src / "include" / "op.h"):
        os.utime(p, ns=(built_at_ns - 5 * NS, built_at_ns - 5 * NS))
    return ext, src / "op.cpp", src / "include" / "op.h"


def test_unchanged_inputs_get_their_recorded_mtime_back(tmp_path: Path) -> None:
    ext, cpp, h = fake_build(tmp_path, 1000 * NS)
    buildcache.record_ninja_inputs(ext)
    for p in (cpp, h):  # a clean clone: the same bytes, installed now
        os.utime(p)
    assert buildcache.restore_ninja_inputs(ext) == 2
    assert cpp.stat().st_mtime_ns == h.stat().st_mtime_ns == 995 * NS


def test_a_changed_input_keeps_its_new_mtime(tmp_path: Path) -> None:
    ext, cpp, h = fake_build(tmp_path, 1000 * NS)
    buildcache.record_ninja_inputs(ext)
    cpp.write_text("int f() { return 2; }\n")  # another version's source: ninja must see it as new
    os.utime(h)
    assert buildcache.restore_ninja_inputs(ext) == 1
    assert cpp.stat().st_mtime_ns > 1000 * NS and h.stat().st_mtime_ns == 995 * NS


def test_a_build_older_than_its_inputs_is_not_recorded(tmp_path: Path) -> None:
    ext, cpp, _ = fake_build(tmp_path, 1000 * NS)
    os.utime(cpp)  # changed after the build (the next job would rebuild): nothing to vouch for
    buildcache.record_ninja_inputs(ext)
    assert not (ext / "op" / buildcache.INPUTS).exists()
    assert buildcache.restore_ninja_inputs(ext) == 0


def test_a_build_missing_from_the_log_is_not_recorded(tmp_path: Path) -> None:
    ext, _, _ = fake_build(tmp_path, 1000 * NS)
    (ext / "op" / ".ninja_log").write_text("# ninja log v5\n")
    buildcache.record_ninja_inputs(ext)
    assert not (ext / "op" / buildcache.INPUTS).exists()
