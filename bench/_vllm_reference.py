"""The reference allocator, kvcached, as an engine kind of bench/bench_vllm.py.

kvcached (github.com/ovg-project/kvcached) is built on the device machine from its own source,
packed on the CPU machine by ``bench/reference/pack_kvcached.sh`` into ``build/kvcached`` (carried
to the device) and built by ``bench/reference/build_kvcached.sh`` into a site folder of its own
(``--kvcached-site``, ``$HOME/kvcached-site``). No kvcached code is in this repository.

How a kvcached engine is enabled, as kvcached's README says for vLLM: ``ENABLE_KVCACHED=true`` and
``KVCACHED_AUTOPATCH=1`` in the engine's environment, and kvcached's ``kvcached_autopatch.pth``
run by the interpreter, which hooks vLLM's import (``wrapt.importer.when_imported``) to apply its
patches. The site folder is not the image's site-packages, so the engine child adds it with
``site.addsitedir`` (which runs the .pth) before it imports vLLM; stock and kvasync engines never
see kvcached. kvasync's own vLLM plugin (installed in the image) is made inert by
``KVASYNC_VLLM=0``, as for stock engines. Each engine gets its own ``KVCACHED_IPC_NAME``.

kvcached patches vLLM ``>=0.8.4`` and says it is tested up to 0.24; this bench runs 0.26. It is run
as it behaves: a start that fails or hangs is reported (with its elapsed time: every wait has a
deadline), never worked around.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "bench" / "reference" / "build_kvcached.sh"
DEFAULT_PACK = REPO / "build" / "kvcached"
DEFAULT_SITE = pathlib.Path.home() / "kvcached-site"
# A build on the H200 machine's 16 cores takes about a minute; past this it is reported as a hang.
BUILD_DEADLINE_S = 300.0


def engine_env(name: str, tag: str) -> dict[str, str]:
    """A kvcached engine's environment: kvcached on, kvasync's plugin inert."""
    return {
        "KVASYNC_VLLM": "0",
        "ENABLE_KVCACHED": "true",
        "KVCACHED_AUTOPATCH": "1",
        # Its shared-memory segment (/dev/shm) and its name in kvcached's kvctl/kvtop.
        "KVCACHED_IPC_NAME": f"kvcached_bench_{tag}_{name}",
    }


def is_reference_key(key: str) -> bool:
    """The environment keys that configure kvcached: kept out of every engine but its own."""
    return key.startswith("KVCACHED_") or key == "ENABLE_KVCACHED"


def built(site: pathlib.Path) -> str | None:
    """The kvcached commit built in ``site``, or None when it holds no build."""
    marker = site / ".kvcached-commit"
    if not marker.is_file() or not list((site / "kvcached").glob("vmm_ops*.so")):
        return None
    return marker.read_text().strip()


def ensure_built(pack: pathlib.Path, site: pathlib.Path, deadline_s: float) -> dict[str, Any]:
    """Builds kvcached into ``site`` from ``pack`` unless that commit is built there already.

    Returns what happened, for the summary: ``commit``, ``seconds``, and ``error`` when the build
    failed, timed out (after ``deadline_s``; the build is killed) or its pack is missing.
    """
    status: dict[str, Any] = {"pack": str(pack), "site": str(site)}
    wanted = (pack / "COMMIT").read_text().strip() if (pack / "COMMIT").is_file() else None
    have = built(site)
    if wanted is None:
        if have is not None:  # built by an earlier call on this machine; no pack carried now
            status.update(commit=have, seconds=0.0, note="already built, no pack carried")
            return status
        status["error"] = (
            f"no kvcached pack at {pack}: run bench/reference/pack_kvcached.sh on the CPU machine "
            "and carry build/kvcached"
        )
        return status
    status["commit"] = wanted
    if have == wanted:
        status.update(seconds=0.0, note="already built")
        return status
    log = site.parent / "kvcached-build.log"
    t = time.monotonic()
    with log.open("w") as sink:
        # Its own session, so that a kill on the deadline takes the compilers with it.
        process = subprocess.Popen(
            ["bash", str(BUILD_SCRIPT), str(pack), str(site)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(10)
            code = None
    status["seconds"] = time.monotonic() - t
    tail = log.read_text(errors="replace").splitlines()[-12:]
    status["log_tail"] = tail
    if code is None:
        status["error"] = f"build hang: not done within {deadline_s:.0f} s (log {log})"
    elif code != 0:
        status["error"] = f"build failed (exit {code}): {(tail or ['(empty log)'])[-1][:300]}"
    elif built(site) != wanted:
        status["error"] = f"build exited 0 but {site} holds no kvcached {wanted}"
    return status


def enable_in_this_process(site: str) -> None:
    """In a kvcached engine's child, before vLLM is imported: kvcached and its .pth hook."""
    import site as site_module
    import sys

    if not (pathlib.Path(site) / "kvcached_autopatch.pth").is_file():
        raise RuntimeError(
            f"kvcached is not built in {site} (no kvcached_autopatch.pth): see "
            "bench/reference/build_kvcached.sh"
        )
    # First on the path, so that its wrapt and posix_ipc win over any the image has; addsitedir
    # then does not add it twice, and runs its .pth files, as for an installed kvcached.
    sys.path.insert(0, site)
    site_module.addsitedir(site)


def summary_line(status: dict[str, Any] | None) -> str:
    """One line on the reference's build for the report."""
    if status is None:
        return "not run (no kvcached engine in this run's modes: see --reference)"
    if "error" in status:
        return f"not run: {status['error']}"
    return (
        f"kvcached {str(status['commit'])[:10]} from source, built in "
        f"{status['seconds']:.0f} s ({status.get('note', 'this call')}); its engines are the "
        "rows named kvcached"
    )


def patch_report(work: pathlib.Path) -> list[str]:
    """What kvcached said of its patches of vLLM in this run's kvcached engines (its log lines
    "Successfully patched vllm: ..." and "Failed to patch vllm: ..."), each distinct line once:
    a patch that fails is logged as a warning and the engine goes on, partly patched."""
    said: dict[str, None] = {}
    for spec_path in sorted(work.rglob("*.spec.json")):
        try:
            if json.loads(spec_path.read_text()).get("kind") != "kvcached":
                continue
            text = spec_path.with_name(spec_path.name[: -len(".spec.json")] + ".log").read_text(
                errors="replace"
            )
        except (OSError, json.JSONDecodeError):
            continue
        for line in text.splitlines():
            for needle in ("Successfully patched vllm", "Failed to patch vllm"):
                at = line.find(needle)
                if at >= 0:
                    said.setdefault(line[at:].strip()[:400])
    return list(said)
