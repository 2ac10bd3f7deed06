"""The suite's fork server (:mod:`zygote`): a process it starts behaves as a plain interpreter would,
as far as the tests that use it can see, and it starts a plain interpreter where it could not."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote
import zygote_flavour
import zygote_server
from conftest import REAL_PYTHON, ZYGOTE, _zygote_child

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not ZYGOTE, reason="UNBROKEN_TEST_ZYGOTE=0")]

SHOW = """
import os, sys, json, signal
json.dump({"argv": sys.argv, "path0": sys.path[0], "file": globals().get("__file__"), "name": __name__,
           "cwd": os.getcwd(), "env": os.environ.get("ZT"), "pid": os.getpid(), "umask": os.umask(0),
           "ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN, "zygote": "torch" in sys.modules,
           "path": sys.path[1:4]}, sys.stdout)
"""


def child_of(proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """The zygote's child standing behind launcher ``proc`` once it runs (``None``: a plain start)."""
    pids = Path(sys.executable).parent.parent / "pids"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        child = _zygote_child(pids, proc.pid)
        if child is not None:
            return child
        time.sleep(0.05)
    return None


def wait_ready() -> None:
    """Until the zygote listens (it imports torch first)."""
    sock = Path(sys.executable).parent.parent / "sock"
    deadline = time.monotonic() + 120
    while not sock.exists():
        assert time.monotonic() < deadline, "the zygote never started listening"
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _ready() -> None:
    wait_ready()


def show(tmp_path: Path, *args: str, **kw: object) -> dict:
    import json
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    out = subprocess.run([sys.executable, *args, str(script), "a", "b"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_script_sees_what_a_plain_interpreter_gives_it(tmp_path: Path) -> None:
    real = Path(sys.executable).parent.parent / "bin" / "python"
    assert real.exists() and sys.executable == str(real), "this file runs with the launcher"
    got = show(tmp_path, env=dict(os.environ, ZT="x"))
    assert got["argv"] == [str(tmp_path / "show.py"), "a", "b"] and got["name"] == "__main__"
    assert got["file"] == str(tmp_path / "show.py") and got["path0"] == str(tmp_path)
    assert got["cwd"] == str(tmp_path) and got["env"] == "x" and got["umask"] == 0o022
    assert got["zygote"], "the child came from the zygote (torch imported before the script ran)"
    old = os.umask(0o077)
    try:
        assert show(tmp_path)["umask"] == 0o077
    finally:
        os.umask(old)


def test_a_module_and_code_and_exit_statuses(tmp_path: Path) -> None:
    run = lambda *a, **kw: subprocess.run([sys.executable, *a], capture_output=True, text=True,  # noqa: E731
                                          cwd=tmp_path, timeout=120, **kw)
    out = run("-m", "json.tool", input='{"a": 1}')
    assert out.returncode == 0 and '"a": 1' in out.stdout
    out = run("-c", "import sys; print(sys.argv); sys.exit(3)", "x")
    assert out.returncode == 3 and out.stdout.strip() == "['-c', 'x']"
    out = run("-c", "def f():\n    raise ValueError('boom')\nf()")
    assert out.returncode == 1
    assert out.stderr.startswith("Traceback (most recent call last):\n  File \"<string>\", line 3"), out.stderr
    assert "zygote" not in out.stderr and out.stderr.rstrip().endswith("ValueError: boom")
    out = run("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert out.returncode == -signal.SIGTERM


def test_signals_reach_the_child_and_a_kill_leaves_nothing(tmp_path: Path) -> None:
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(75)))\n"
            "print('ready', flush=True)\nwhile True: time.sleep(0.1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout and proc.stdout.readline() == "ready\n"
    child = child_of(proc)
    assert child and child != proc.pid
    os.kill(proc.pid, signal.SIGTERM)  # to the launcher: forwarded
    assert proc.wait(60) == 75 and proc.stdout.read() == "term\n"
    assert not Path(f"/proc/{child}").exists()
    for kill in (lambda p: p.kill(), lambda p: os.kill(p.pid, signal.SIGKILL)):  # the child, or the launcher
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout and proc.stdout.readline() == "ready\n"
        child = child_of(proc)
        kill(proc)
        assert proc.wait(60) == -signal.SIGKILL
        if kill.__code__.co_names == ("kill",):  # proc.kill(): the child itself, gone before wait returned
            assert not Path(f"/proc/{child}").exists()
        else:  # the launcher: the zygote kills the child before it starts the next process
            subprocess.run([sys.executable, "-c", "pass"], timeout=120, check=True)
            assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_a_stopped_child_stops_its_launcher(tmp_path: Path) -> None:
    code = "import os, signal; print('a', flush=True); os.kill(os.getpid(), signal.SIGSTOP); print('b')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout and proc.stdout.readline() == "a\n"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "T":
        assert time.monotonic() < deadline, "the launcher did not stop with its child"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(60) == 0 and proc.stdout.read() == "b\n"


def test_descriptors_and_signal_dispositions_are_inherited(tmp_path: Path) -> None:
    """A descriptor of ``pass_fds`` arrives under its number; the signal dispositions are those a plain
    interpreter shows, with one ignored by the parent (SIGUSR2)."""
    code = ("import os, signal, sys\nos.write(int(sys.argv[1]), b'through')\n"
            "print([repr(signal.getsignal(s)) for s in signal.valid_signals() if s not in (9, 19)])")
    got = []
    for python in (sys.executable, REAL_PYTHON):
        r, w = os.pipe()
        out = subprocess.run([python, "-c", code, str(w)], capture_output=True, text=True, pass_fds=(w,),
                             timeout=120, preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
        os.close(w)
        assert os.read(r, 100) == b"through", out.stderr
        os.close(r)
        got.append(out.stdout)
    assert got[0] == got[1]


@pytest.mark.parametrize("case", ["option", "shadow", "hashseed", "torch-env"])
def test_what_the_zygote_cannot_give_starts_plainly(tmp_path: Path, case: str) -> None:
    """A plain start is an ``exec`` of the real interpreter: the same pid as the launcher."""
    args, env = ["-c", "import os, sys; print(os.getpid(), 'torch' in sys.modules)"], dict(os.environ)
    if case == "option":
        args = ["-O", *args]
    elif case == "shadow":  # a folder on the path with a module the zygote imported: it must win
        (tmp_path / "numpy.py").write_text("")
        env["PYTHONPATH"] = str(tmp_path)
    elif case == "hashseed":
        env["PYTHONHASHSEED"] = "12345"
    else:
        env["OMP_SCHEDULE"] = "static,3"  # read by OpenMP when torch loaded it
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=120)
    pid, torch_loaded = out.split()
    assert int(pid) == proc.pid and torch_loaded == "False", out


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_what_an_import_read_from_the_environment_is_what_a_plain_interpreter_reads() -> None:
    """torchrun's agent logs at the level ``LOGLEVEL`` had when torch's elastic package was imported, which
    the zygote did with its own environment: a launch with another value must see its own (it once did not:
    the goodput benchmark's timeline lost the agent's INFO lines whenever its torchrun came from the zygote).
    The child sets the level of each such logger the zygote's imports made, as they would have (it is forked)."""
    code = ("import sys; forked = 'torch' in sys.modules\nimport logging, torch.distributed.run\n"
            "print(forked, logging.getLogger('torch.distributed.elastic.agent.server.api').getEffectiveLevel(),"
            "logging.getLogger('torch.distributed.run').getEffectiveLevel())")
    for level, number in (("INFO", "20"), (None, "30"), ("DEBUG", "10")):
        env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | ({"LOGLEVEL": level} if level else {})
        got = [subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
               .stdout.split()[-3:] for python in (sys.executable, REAL_PYTHON)]
        assert got == [["True", number, number], ["False", number, number]], (level, got)


def test_importing_unbroken_reads_nothing_of_the_environment() -> None:
    """The zygote imports unbroken (zygote_server.PRELOAD) with its own environment: whatever unbroken read
    then would be the zygote's, not the job's (``UNBROKEN_FAULTS``, ``RANK``...), and every job with another
    value would start plainly. So unbroken reads its variables when it acts, in the process that acts."""
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); import zygote_server as z\n"
            "heavy = [n for n in z.PRELOAD if not n.startswith('unbroken')]\n"
            "[importlib.import_module(n) for n in heavy]\n"
            "with z.reads_of_environ() as read:\n"
            "    [importlib.import_module(n) for n in z.PRELOAD if n.startswith('unbroken')]\n"
            "print(sorted(read))")
    out = subprocess.run([REAL_PYTHON, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, UNBROKEN_FAULTS="save.mid_file=1", RANK="1"))
    assert out.returncode == 0, out.stderr
    read = eval(out.stdout.strip().splitlines()[-1])
    assert set(read) <= {"TYPER_USE_RICH"}, f"read at import (typer's own aside): {read}"


def test_the_reads_recorded_are_reads_by_name_not_scans(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the zygote compares: variables read by name while it imports; not every variable present when
    an import copied or iterated over the whole environment (fsspec's ``dict(os.environ)``, tqdm's
    ``items()``: that made every launch with another value of any variable start plainly)."""
    for name in ("ZYG_A", "ZYG_B", "ZYG_C"):
        monkeypatch.setenv(name, "1")
    getitem = type(os.environ).__getitem__

    def scans() -> None:
        assert dict(os.environ)["ZYG_C"] == "1" and [k for k, _ in os.environ.items() if k.startswith("ZYG")]

    with zygote_server.reads_of_environ() as read:
        os.environ.get("ZYG_A"), "ZYG_B" in os.environ, os.getenv("ZYG_NONE")
        scans()
    assert {"ZYG_A", "ZYG_B", "ZYG_NONE"} <= read and "ZYG_C" not in read, read
    assert type(os.environ).__getitem__ is getitem  # put back


def test_parse() -> None:
    assert zygote.parse(["-u", "x.py", "-m", "y"]) == ("script", "x.py", ["-u"], ["-m", "y"])
    assert zygote.parse(["-X", "faulthandler", "-mpkg.mod", "a"]) == ("-m", "pkg.mod", ["faulthandler"], ["a"])
    assert zygote.parse(["-c", "code", "-u"]) == ("-c", "code", [], ["-u"])
    assert isinstance(zygote.parse(["-O", "x.py"]), str) and isinstance(zygote.parse([]), str)
    assert isinstance(zygote.parse(["-"]), str) and isinstance(zygote.parse(["-X", "dev", "x.py"]), str)


@pytest.mark.slow  # a network namespace: the whole suite's tier (docs/testing.md)
def test_a_launch_inside_a_network_namespace_is_forked_into_it() -> None:
    """A launcher started by ``ip netns exec`` (a node of tests/netns.py) is served: the child joins the
    namespace's network (its interfaces) and its mounts (the namespace's own ``/sys``); the node's processes,
    as tests/netns.py lists them, are the child, not the launcher standing for it."""
    import json

    import netns
    if (why := netns.available()) is not None:  # as test_multinode.py: CI (.ci/run) requires the namespaces
        if os.environ.get("UNBROKEN_REQUIRE_NETNS"):
            pytest.fail(why)
        pytest.skip(why)
    code = ("import json, os, socket, sys; print(json.dumps([os.getpid(), 'torch' in sys.modules, "
            "os.readlink('/proc/self/ns/net'), sorted(n for _, n in socket.if_nameindex()), "
            "sorted(os.listdir('/sys/class/net'))]), flush=True); import time; time.sleep(3600)")
    with netns.Cluster(1) as cluster:
        (node,) = cluster.nodes
        proc = node.start([sys.executable, "-c", code], dict(os.environ))
        deadline = time.monotonic() + 120
        while not proc.lines and time.monotonic() < deadline and proc.popen.poll() is None:
            time.sleep(0.05)
        pid, forked, net, interfaces, in_sys = json.loads(proc.lines[0])
        assert forked and pid != proc.popen.pid, proc.output  # served by the zygote, not a plain start
        assert net == f"net:[{os.stat(f'/run/netns/{node.name}').st_ino}]", net
        assert interfaces == in_sys == sorted(["lo", netns.IFNAME]), (interfaces, in_sys)
        assert node.pids() == [pid]  # the launcher (proc.popen.pid) stands for it
        assert proc.popen.pid in netns._pids(node.name)
    assert proc.wait(60) is not None


def test_the_refusals(tmp_path: Path) -> None:
    """The rules, one by one, on a server that is not listening."""
    z = zygote_server.Zygote.__new__(zygote_server.Zygote)
    z.identity, z.top, z.env = zygote.identity(), {"torch", "numpy", "unbroken"}, dict(os.environ, PYTHONHASHSEED="1")
    z.origins = {name: zygote_server._origin(importlib.import_module(name)) for name in z.top}
    z.strict, z.read = False, {"CXX"}
    z.place = zygote.place()
    req = lambda args, **kw: dict(dict(args=args, env=z.env, cwd=str(tmp_path), identity=z.identity,  # noqa: E731
                                       place=z.place), **kw)
    assert z._refuse(req(["x.py"])) is None
    node = dict(z.place, net="net:[1]", mnt="mnt:[2]")  # a node of tests/netns.py: joined, as root
    assert z._refuse(req(["x.py"], place=node)) == (None if os.geteuid() == 0 else
                                                    "another network or mount namespace (joining one needs root)")
    if os.geteuid() == 0:
        assert z._refuse(req(["x.py"], place=dict(node, mounts=node["mounts"] + "\n0:99 / /mnt tmpfs x"))) == \
            "other mounts"
    assert z._refuse(req(["x.py"], env=dict(z.env, PYTHONHASHSEED="2"))) == "PYTHONHASHSEED differs"
    assert "depends on its parent" in z._refuse(req(["-m", "unbroken.checkpoint.background.filewriter", "3"]))
    assert "namespace" in z._refuse(req(["x.py"], identity="Uid: 1000"))
    assert z._refuse(req(["x.py"], env=dict(z.env, TORCH_LOGS="+dynamo"))) == "TORCH_LOGS differs"
    assert z._refuse(req(["x.py"], env=dict(z.env, UNBROKEN_X="1"))) is None
    assert z._refuse(req(["x.py"], env=dict(z.env, CXX="clang++"))).startswith("CXX differs (read when")
    assert z._refuse(req(["x.py"], env=dict(z.env, LOGLEVEL="INFO"))) is None  # set in the child (the loggers')
    assert z._refuse(req(["x.py"], env=dict(z.env, LOGLEVEL="info"))) == "LOGLEVEL='info' is no level"
    (tmp_path / "torch").mkdir()
    assert z._refuse(req(["x.py"])) is None, "a folder without __init__.py is not a package"
    (tmp_path / "torch" / "__init__.py").write_text("")
    assert "holds torch" in z._refuse(req(["x.py"]))
    (tmp_path / "torch" / "__init__.py").unlink()
    mine = os.path.dirname(z.origins["unbroken"])  # the zygote's own unbroken on the path: no shadow
    assert z._refuse(req(["-m", "json.tool"], env=dict(z.env, PYTHONPATH=mine))) is None
    other = tmp_path / "other"
    (other / "unbroken").mkdir(parents=True)
    (other / "unbroken" / "__init__.py").write_text("")  # another version of it: a plain start
    assert "holds unbroken" in z._refuse(req(["-m", "json.tool"], env=dict(z.env, PYTHONPATH=str(other))))


def test_the_number_of_threads_is_what_the_environment_asks() -> None:
    """``OMP_NUM_THREADS`` was read when the zygote loaded torch and numpy's OpenBLAS: the child sets both."""
    code = ("import ctypes, os, torch, numpy\n"
            "lib = [ln.split()[-1] for ln in open('/proc/self/maps') "
            "if 'openblas' in ln and ln.rstrip().endswith('.so')]\n"
            "blas = ctypes.CDLL(lib[0]).scipy_openblas_get_num_threads64_()\n"
            "print(os.getpid(), torch.get_num_threads(), torch.get_num_interop_threads(), blas)")
    got = []
    for python in (sys.executable, REAL_PYTHON):
        proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        out, _ = proc.communicate(timeout=120)
        pid, *threads = out.split()
        assert (int(pid) != proc.pid) == (python == sys.executable), "the first from the zygote, the second plain"
        got.append(threads)
    assert got[0] == got[1] == [got[1][0], got[1][1], got[1][2]] and got[1][0] == "1" and got[1][2] == "1", got


def test_a_script_beside_the_fork_server_s_own_modules_is_served() -> None:
    """The test scripts (tests/dist_train.py, ds_train.py, ...) live in the folder of zygote*.py, which the
    zygote imported: that folder first on the script's path must not count as shadowing them (it did once,
    silently: every such script started plainly, at several seconds of imports each)."""
    here = Path(__file__).parent  # -c puts the working folder first on the path, as a script puts its own
    proc = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], cwd=here,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and int(out) != proc.pid, "started plainly"


def test_a_child_s_children_start_from_the_zygote_too() -> None:
    """``sys.executable`` is the launcher in the child as here: torchrun's ranks and a CLI's jobs fork too."""
    code = ("import os, subprocess, sys\n"
            "inner = subprocess.run([sys.executable, '-c', 'import os; print(os.getppid())'], capture_output=True,"
            " text=True, check=True)\nprint(os.getppid(), inner.stdout.strip(), sys.executable)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    outer, inner, exe = out.stdout.split()
    assert outer == inner and exe == sys.executable, out.stdout


def test_which_scripts_go_to_a_framework_s_zygote(tmp_path: Path) -> None:
    """The framework imports a script runs first thing, and only while nothing of its own ran before."""
    def key(src: str, **env: str) -> tuple | None:
        (tmp_path / "s.py").write_text(src)
        return zygote_flavour.flavour({"args": ["s.py"], "cwd": str(tmp_path), "env": env}, {"os", "sys", "torch"})
    assert key('"""doc"""\nimport os, sys\nimport torch\nimport transformers\nfrom transformers import Trainer\nx = 1\n'
               "import lightning\n", HF_HOME="/h", PATH="/bin") == (
        ("import transformers", "from transformers import Trainer"), (("HF_HOME", "/h"),))
    assert key("import unbroken\nimport transformers\n") is None, "a module of its own first: nothing"
    assert key("x = 1\nimport transformers\n") is None
    assert key("import os\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\nimport deepspeed\n") is None
    assert key("import os\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\nimport deepspeed\n",
               DS_ACCELERATOR="cpu") == (("import deepspeed",), (("DS_ACCELERATOR", "cpu"),))
    assert key("import os\nos.environ['X'] = '1'\nimport transformers\n") is None
    assert key("import transformers, json\n") is None, "a module of its own in the same statement"
    guarded = "import os\nif 'LOCAL_RANK' in os.environ and 'TORCHELASTIC_RUN_ID' not in os.environ:\n" \
              "    os.environ['RANK'] = os.environ['LOCAL_RANK']\nimport pytorch_lightning\n"
    assert key(guarded, LOCAL_RANK="1", TORCHELASTIC_RUN_ID="x") == (("import pytorch_lightning",),
                                                                     (("LOCAL_RANK", "1"),))
    assert key(guarded, LOCAL_RANK="1") is None, "the if changes the environment here: nothing"


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_framework_s_zygote_serves_the_next_launches(tmp_path: Path) -> None:
    script = tmp_path / "fw.py"
    script.write_text("import os\nimport sys\nimport transformers\nprint(os.getppid(), 'tokenizers' in sys.modules)\n")
    run = lambda: subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,  # noqa: E731
                                 check=True).stdout.split()
    socks = lambda: set(Path(sys.executable).parent.parent.glob("sock-*"))  # noqa: E731
    before = socks()
    first, _ = run()
    deadline = time.monotonic() + 300
    while not socks() - before:  # this script's framework zygote (another test's may exist already)
        assert time.monotonic() < deadline, "the framework's zygote never listened"
        time.sleep(0.2)
    second, _ = run()
    assert second != first, "the second launch came from the framework's zygote, forked from the first zygote"
    assert run()[0] == second


def test_warning_filters_are_those_of_a_plain_interpreter() -> None:
    """``PYTHONWARNINGS`` and ``-W`` were read at the zygote's start, without them: the child orders its
    filters as a plain interpreter does (after what the imports added, before the interpreter's own)."""
    code = ("import importlib, os, sys, warnings\nprint(os.getpid())\n"
            f"for name in {zygote_server.PRELOAD!r}:\n    importlib.import_module(name)\n"
            "print(sys.warnoptions)\n"
            "print([(f[0], str(f[1]), f[2].__name__, str(f[3]), f[4]) for f in warnings.filters])")
    got = []
    for python in (sys.executable, REAL_PYTHON):
        proc = subprocess.Popen([python, "-W", "error::UserWarning", "-c", code], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONWARNINGS="ignore,default::DeprecationWarning"))
        out, _ = proc.communicate(timeout=300)
        pid, out = out.split("\n", 1)
        assert proc.returncode == 0 and (int(pid) != proc.pid) == (python == sys.executable), "zygote, then plain"
        got.append(out)
    assert got[0] == got[1], got
    assert "'ignore', 'default::DeprecationWarning', 'error::UserWarning'" in got[0]


def test_a_pinned_hash_seed_gets_a_zygote_of_its_own() -> None:
    """``PYTHONHASHSEED`` is fixed when an interpreter starts: the first launch that pins another seed
    starts plainly and has a zygote started with it, which serves the next ones (the same hashes)."""
    code = "import os; print(os.getpid(), hash('unbroken'))"
    env = dict(os.environ, PYTHONHASHSEED="4242")
    plain = subprocess.run([REAL_PYTHON, "-c", code], capture_output=True, text=True, env=env, check=True)
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=300)
    sock = Path(sys.executable).parent.parent / "sock-hash4242"
    deadline = time.monotonic() + 300
    while not sock.exists():
        assert time.monotonic() < deadline, "the zygote of that seed never listened"
        time.sleep(0.2)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=300)
    pid, value = out.split()
    assert int(pid) != proc.pid, "served by a zygote"
    assert value == plain.stdout.split()[1], "the hashes of that seed"
