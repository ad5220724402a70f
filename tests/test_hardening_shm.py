"""Hardening (issue 14): shared-memory trouble is an error, not a crash, and the model cache.

4. A nearly full /dev/shm: a clear error (needed, free, how to change the ring size), never a
   SIGBUS, nothing left behind; checked in a 24 MiB tmpfs mounted over /dev/shm in a private
   mount namespace (`unshare -m`, as root).
5. The sweep of stale rings skips (and logs) what it cannot remove or does not own.
9. An unwritable model cache is an error naming SHMVLLM_CACHE, before the conversion.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ipc.segment import SHM_DIR, pid_alive

REPO = Path(__file__).resolve().parents[1]


def _unshare_problem() -> str | None:
    """Why a private mount namespace cannot be had here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (mounting a tmpfs in a private mount namespace)"
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True, text=True,
    )
    if probe.returncode != 0:
        return f"unshare -m is not permitted here: {probe.stderr.strip()}"
    return None


UNSHARE_PROBLEM = _unshare_problem()
needs_unshare = pytest.mark.skipif(UNSHARE_PROBLEM is not None, reason=UNSHARE_PROBLEM or "")


def run_in_small_shm(script: str, free_mib: int = 6, size_mib: int = 24, env: dict | None = None, timeout: float = 240):
    """Runs `script` (python) with /dev/shm a fresh `size_mib` tmpfs filled to within `free_mib`,
    in a private mount namespace; returns the completed process. The script's last line of
    output lists what was left in /dev/shm besides the filler."""
    shell = textwrap.dedent(f"""\
        set -e
        mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm
        avail=$(df -B1 --output=avail /dev/shm | tail -1)
        fallocate -l $((avail - {free_mib} * 1048576)) /dev/shm/filler
        set +e
        "{sys.executable}" -c "$SCRIPT"
        code=$?
        echo "LEFT $(ls /dev/shm | grep -v '^filler$' | tr '\\n' ' ')"
        exit $code
        """)
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), "SCRIPT": script, **(env or {})},
    )


@needs_unshare
def test_4_llm_in_a_nearly_full_dev_shm_is_a_clear_error(tiny_llama_dir):
    script = textwrap.dedent(f"""\
        from shmvllm import LLM
        if __name__ == "__main__":
            try:
                LLM({str(tiny_llama_dir)!r}, max_model_len=128, num_kv_blocks=16)
            except OSError as exc:
                print("ERROR", type(exc).__name__, exc)
            else:
                print("NO ERROR")
        """)
    done = run_in_small_shm(script)
    assert done.returncode == 0, f"exit {done.returncode} (SIGBUS is -7 / 135)\n{done.stdout}\n{done.stderr}"
    error = next(line for line in done.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR SharedMemoryFullError"), error
    for words in ("needed", "free", "/dev/shm", "SHMVLLM_RING_CAPACITY"):
        assert words in error
    assert done.stdout.splitlines()[-1].strip() == "LEFT", done.stdout  # nothing behind


@needs_unshare
def test_4_a_smaller_ring_capacity_fits_and_serves(tiny_llama_dir):
    script = textwrap.dedent(f"""\
        from shmvllm import LLM, SamplingParams
        if __name__ == "__main__":
            with LLM({str(tiny_llama_dir)!r}, max_model_len=128, num_kv_blocks=16) as llm:
                out = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
                print("TOKENS", len(out[0].outputs[0].token_ids))
        """)
    done = run_in_small_shm(script, env={"SHMVLLM_RING_CAPACITY": str(1 << 20)})
    assert done.returncode == 0, done.stderr
    assert "TOKENS 3" in done.stdout
    assert done.stdout.splitlines()[-1].strip() == "LEFT", done.stdout


@needs_unshare
def test_4_rings_never_sigbus_even_when_the_check_is_raced():
    """The free-space check passes, then the space is gone (another process took it): the
    segment's allocation fails with the same error instead of a later page fault's SIGBUS."""
    script = textwrap.dedent("""\
        import json
        import ipc.ring, ipc.segment
        from ipc import RingBuffer, SharedMemoryFullError
        results = {}
        try:
            RingBuffer.create(8 << 20)
        except SharedMemoryFullError as exc:
            results["checked"] = [exc.needed, exc.free]
        ipc.ring.check_free_space = ipc.segment.check_free_space = lambda *a, **k: None  # the race
        try:
            ring = RingBuffer.create(8 << 20)
            ring._mv[-1] = 1  # the last page: a SIGBUS if it was never allocated
        except SharedMemoryFullError as exc:
            results["raced"] = [exc.needed, exc.free]
        ring = RingBuffer.create(1 << 20, prefault=True)
        ring.push(b"x" * 1000)
        ring.close()
        print(json.dumps(results))
        """)
    done = run_in_small_shm(script)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr}"
    results = json.loads(done.stdout.splitlines()[-2])
    assert results["checked"][0] > 8 << 20 and results["checked"][1] <= 6 << 20
    assert results["raced"][0] >= 8 << 20
    assert done.stdout.splitlines()[-1].strip() == "LEFT", done.stdout


def test_4_ring_capacity_env_is_validated(monkeypatch):
    from shmvllm.boundary import channel

    for raw in ("abc", "12", "0", str(1 << 40)):
        monkeypatch.setenv("SHMVLLM_RING_CAPACITY", raw)
        with pytest.raises(ValueError, match="SHMVLLM_RING_CAPACITY"):
            channel.ring_capacity()
    monkeypatch.setenv("SHMVLLM_RING_CAPACITY", "65536")
    assert channel.ring_capacity() == 65536


# ---- 5. the sweep --------------------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm listing to sweep")
def test_5_sweep_skips_and_logs_what_it_cannot_remove_or_does_not_own(caplog):
    from ipc import sweep_stale_segments
    from shmvllm.boundary import channel

    pid = _dead_pid()
    directory = SHM_DIR / f"ipcring-{pid}-{secrets.token_hex(8)}"
    foreign = SHM_DIR / f"ipcring-{pid}-{secrets.token_hex(8)}"
    ours = SHM_DIR / f"ipcring-{pid}-{secrets.token_hex(8)}"
    directory.mkdir()
    (directory / "inside").write_text("x")
    foreign.write_text("another user's")
    ours.write_text("ours")
    can_chown = os.geteuid() == 0
    if can_chown:
        os.chown(foreign, 65534, 65534)
    try:
        with caplog.at_level(logging.WARNING, logger="ipc.segment"):
            removed = sweep_stale_segments()
            endpoint, _ = channel.open_frontend()  # what every LLM() does first
            endpoint.close()
        assert "/" + ours.name in removed and not ours.exists()
        assert directory.exists() and "not a regular file" in caplog.text and directory.name in caplog.text
        if can_chown:
            assert foreign.exists() and "owned by uid 65534" in caplog.text
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        foreign.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)


# ---- 9. the model cache ----------------------------------------------------------------------

_RESOLVE = textwrap.dedent("""\
    import time
    from shmvllm.model.registry import resolve_model_dir
    started = time.monotonic()
    try:
        resolve_model_dir("smollm2-135m-instruct")
    except OSError as exc:
        print("ERROR", round(time.monotonic() - started, 1), exc)
    else:
        print("NO ERROR")
    """)


def _resolve_with(env: dict, wrapper: list[str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if k != "SHMVLLM_CACHE"}
    done = subprocess.run(
        [*(wrapper or []), sys.executable, "-c", _RESOLVE], capture_output=True, text=True, timeout=240,
        env={**base, "PYTHONPATH": str(REPO), **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_9_an_unwritable_home_is_an_error_naming_shmvllm_cache(tmp_path):
    not_a_dir = tmp_path / "home-is-a-file"
    not_a_dir.write_text("")
    line = _resolve_with({"HOME": str(not_a_dir)})
    assert line.startswith("ERROR") and "SHMVLLM_CACHE" in line, line
    assert float(line.split()[1]) < 5  # found before the conversion, not after it


def test_9_an_unwritable_shmvllm_cache_is_named(tmp_path):
    not_a_dir = tmp_path / "cache-is-a-file"
    not_a_dir.write_text("")
    line = _resolve_with({"SHMVLLM_CACHE": str(not_a_dir / "sub")})
    assert line.startswith("ERROR") and "$SHMVLLM_CACHE" in line and str(not_a_dir) in line, line


@needs_unshare
def test_9_a_read_only_home_is_an_error_naming_shmvllm_cache(tmp_path):
    home = tmp_path / "ro-home"
    home.mkdir()
    script = _RESOLVE.replace('"', '\\"')
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o ro tmpfs "{home}" && HOME="{home}" "{sys.executable}" -c "{script}"'],
        capture_output=True, text=True, timeout=240,
        env={**{k: v for k, v in os.environ.items() if k != "SHMVLLM_CACHE"}, "PYTHONPATH": str(REPO)},
    )
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR") and "SHMVLLM_CACHE" in line and "Read-only" in line, (line, done.stderr)
    assert float(line.split()[1]) < 5
