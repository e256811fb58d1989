"""The reference allocator, kvcached, as the candidate of bench/bench_sglang.py (``--candidate
kvcached``).

kvcached (github.com/ovg-project/kvcached) is packed on the CPU machine by
``bench/reference/pack_kvcached.sh`` into ``build/kvcached`` and built on the device machine by
``bench/reference/build_kvcached.sh`` into a site folder of its own (``--kvcached-site``), as for
bench/bench_vllm.py (``bench/_vllm_reference.py`` builds it). No kvcached code is in this
repository.

How kvcached enters SGLang, as its SGLang integration does: its ``kvcached_autopatch.pth`` hooks
the import of ``sglang`` (``wrapt.importer.when_imported``); with ``ENABLE_KVCACHED=true`` and
``KVCACHED_AUTOPATCH=1`` that hook imports ``kvcached.integration.sglang.autopatch``, which
imports SGLang's memory pool, allocator, model runner, scheduler and radix cache modules and puts
its elastic classes in place of SGLang's (``Elastic*`` classes bound to SGLang's names, and
wrapped methods that carry a ``__kvcached_patched_*`` marker).

The .pth runs only where kvcached's folder is added as a site (``site.addsitedir``). A kvcached
engine's child does so before it imports SGLang. SGLang then starts its scheduler and detokenizer
with multiprocessing's *spawn*: each is a fresh interpreter that re-imports the child's main
script (bench_sglang.py) as ``__mp_main__`` before it unpickles (and so imports) SGLang's process
function. Those processes inherit the environment but not the import hook, so bench_sglang.py calls
``enter_if_kvcached`` at import in both cases: where ``KVCACHED_BENCH_SITE`` is set (only in a
kvcached engine's environment), it adds the site again, which runs the .pth again. The KV pool lives
in the scheduler process, so that is where the patches must be.

What was patched is recorded, not assumed: after kvcached's hook, a hook of this module writes a
probe of the process's SGLang modules (``probe``) to ``KVCACHED_BENCH_PROBE.<pid>.json``; in a
spawned process it writes it again once multiprocessing names the process's function (the
scheduler's is ``run_scheduler_process``). The engine child reports the probes as its ``kvcached``
event; the driver adds kvcached's own log lines on its patches (``log_lines``).

kvcached's SGLang defaults worth knowing: ``KVCACHED_MAX_CACHED_TOKENS`` (16,000 by default)
caps what SGLang's radix cache keeps after a request finishes (kvcached evicts past it), so prefix
hits can be fewer than stock's; ``--kvcached-max-cached-tokens -1`` lifts the cap. Its mapped KV
is read from the shared-memory segment it keeps per engine (``KVCACHED_IPC_NAME``, in /dev/shm:
total, used and preallocated bytes, three int64), by ``KvcachedSampler``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import re
import struct
import sys
import threading
import time
from typing import Any

from _vllm_reference import BUILD_DEADLINE_S, DEFAULT_PACK, DEFAULT_SITE

SITE_ENV = "KVCACHED_BENCH_SITE"  # kvcached's built site; set only for a kvcached engine
PROBE_ENV = "KVCACHED_BENCH_PROBE"  # each process of that engine writes <this>.<pid>.json
SHM_DIR = pathlib.Path("/dev/shm")
GIB = 2**30
# What kvcached says in its log about its patches and its classes in use.
LOG_NEEDLES = (
    "patched sglang",
    "patch sglang",
    "Failed to apply",
    "Error applying",
    "Could not import target module",
    "in use",
    "capped at",
    "virtual KV capacity",
    "process-local KV capacity",
)


def ipc_name(tag: str, name: str) -> str:
    """A kvcached segment name for one engine (kvcached keeps letters, digits, ``_`` and ``-``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"kvcached_sgl_{tag}_{name}")


def engine_env(
    name: str,
    tag: str,
    *,
    site: str,
    probe_prefix: str,
    max_cached_tokens: int | None = None,
) -> dict[str, str]:
    """A kvcached engine's environment: kvcached on (its README's two variables), kvasync's
    plugin inert, its own segment name, and where this bench finds its site and writes probes."""
    env = {
        "KVASYNC_SGLANG": "0",
        "ENABLE_KVCACHED": "true",
        "KVCACHED_AUTOPATCH": "1",
        "KVCACHED_IPC_NAME": ipc_name(tag, name),
        "KVCACHED_LOG_COLOR": "false",
        SITE_ENV: site,
        PROBE_ENV: probe_prefix,
    }
    if max_cached_tokens is not None:
        env["KVCACHED_MAX_CACHED_TOKENS"] = str(max_cached_tokens)
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """bench_sglang.py's options for kvcached."""
    parser.add_argument(
        "--kvcached-pack",
        type=pathlib.Path,
        default=DEFAULT_PACK,
        help="kvcached's source and wheels (bench/reference/pack_kvcached.sh)",
    )
    parser.add_argument(
        "--kvcached-site",
        type=pathlib.Path,
        default=DEFAULT_SITE,
        help="where kvcached is built (bench/reference/build_kvcached.sh; a build of the same "
        "commit there is kept)",
    )
    parser.add_argument("--kvcached-build-deadline-s", type=float, default=BUILD_DEADLINE_S)
    parser.add_argument(
        "--kvcached-max-cached-tokens",
        type=int,
        default=None,
        help="kvcached's KVCACHED_MAX_CACHED_TOKENS, its cap on SGLang's radix cache after each "
        "request (unset: kvcached's default, 16,000 tokens; -1: no cap, as stock)",
    )


def engine_env_in(
    folder: pathlib.Path, name: str, tag: str, args: argparse.Namespace
) -> dict[str, str]:
    """``engine_env`` for an engine whose files are in ``folder`` (its probes too: stale ones
    from an earlier run there are removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder / f"{name}.kvcached-probe"
    for stale in folder.glob(f"{prefix.name}.*"):
        stale.unlink(missing_ok=True)
    return engine_env(
        name,
        tag,
        site=str(args.kvcached_site),
        probe_prefix=str(prefix),
        max_cached_tokens=args.kvcached_max_cached_tokens,
    )


def report(name: str, env: dict[str, str], log: pathlib.Path) -> dict[str, Any]:
    """Whether kvcached patched an engine's SGLang, process by process (its probes), and what
    kvcached logged on it; one line printed."""
    probes = read_probes(env[PROBE_ENV])
    summary = summarize(probes)
    print(
        f"{name}: kvcached's patches in the scheduler process: "
        f"{'yes' if summary['scheduler_patched'] else 'NO'} ({summary['processes']} "
        f"processes probed: {', '.join(summary['roles']) or 'none'})",
        flush=True,
    )
    return {"summary": summary, "probes": probes, "log": log_lines(log)}


def enter_if_kvcached(*, spawned: bool) -> bool:
    """In a kvcached engine's processes, before SGLang is imported: kvcached's site and its .pth
    hook, then this module's probe hook. ``spawned``: SGLang's own process (``__mp_main__``).
    Does nothing where ``KVCACHED_BENCH_SITE`` is unset (stock and kvasync engines, the driver)."""
    site = os.environ.get(SITE_ENV)
    if not site:
        return False
    if not (pathlib.Path(site) / "kvcached_autopatch.pth").is_file():
        raise RuntimeError(
            f"kvcached is not built in {site} (no kvcached_autopatch.pth): see "
            "bench/reference/build_kvcached.sh"
        )
    import site as site_module

    # First on the path, so that its wrapt and posix_ipc win over others; a spawned process has
    # it on sys.path already (multiprocessing passes the parent's), but not the hook: addsitedir
    # runs the site's .pth files whether or not the folder is on the path.
    if site not in sys.path:
        sys.path.insert(0, site)
    site_module.addsitedir(site)
    prefix = os.environ.get(PROBE_ENV)
    if prefix:
        # Registered after the .pth's hook, so it runs after kvcached has patched (wrapt runs a
        # module's hooks in order, and kvcached's own hook runs at once inside the first).
        importer = importlib.import_module("wrapt.importer")  # kvcached's dependency, in its site
        importer.when_imported("sglang")(lambda _module: _probe_hook(prefix, spawned))
    return True


def _probe_hook(prefix: str, spawned: bool) -> None:
    write_probe(prefix, "spawned" if spawned else "engine", "at sglang's import")
    if spawned:  # once the process's function is known (multiprocessing's bootstrap sets it)
        threading.Thread(target=_late_probe, args=(prefix,), daemon=True).start()


def _late_probe(prefix: str, within_s: float = 300.0) -> None:
    import multiprocessing

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        target = getattr(multiprocessing.current_process(), "_target", None)
        if target is not None:
            role = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
            write_probe(prefix, role, "after the process started")
            return
        time.sleep(0.1)


def write_probe(prefix: str, role: str, when: str) -> None:
    record = {"pid": os.getpid(), "role": role, "when": when, "wall": time.time(), **probe()}
    path = pathlib.Path(f"{prefix}.{os.getpid()}.json")
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def _from_kvcached(obj: Any) -> bool:
    """Whether a class or function is kvcached's: defined in its package (a class's module, or a
    function's source file under a ``kvcached`` folder)."""
    if isinstance(obj, type):
        return obj.__module__.split(".")[0] == "kvcached"
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    return code is not None and "kvcached" in pathlib.PurePath(code.co_filename).parts[:-1]


def probe(modules: dict[str, Any] | None = None) -> dict[str, Any]:
    """What kvcached patched, as this process's SGLang modules show it:

    - ``bound``: for each ``sglang`` module, its globals bound to one of kvcached's classes (under
      SGLang's names or their own), ``{module: {name: class}}``;
    - ``stale``: modules, other than a class's own, that bind one of those SGLang names to SGLang's
      class (they took it before kvcached bound its own, or import it from where it is defined);
    - ``replaced``: ``module.Class.method`` of SGLang's classes that are now kvcached's functions
      (its wrappers), each with the markers kvcached set on it;
    - ``marked``: modules carrying kvcached's ``__kvcached*`` markers;
    - ``patched``: whether kvcached's pool and paged allocator are bound under SGLang's names in
      SGLang's memory pool and allocator modules.
    """
    modules = dict(sys.modules) if modules is None else modules
    bound: dict[str, dict[str, str]] = {}
    replaced: dict[str, list[str]] = {}
    marked: dict[str, list[str]] = {}
    classes: dict[str, dict[str, type]] = {}
    for module_name, module in sorted(modules.items()):
        if not (module_name == "sglang" or module_name.startswith("sglang.")) or module is None:
            continue
        names = getattr(module, "__dict__", {})
        classes[module_name] = {}
        for key, value in list(names.items()):
            if key.startswith("__kvcached") and value is True:
                marked.setdefault(module_name, []).append(key)
            if not isinstance(value, type):
                continue
            if _from_kvcached(value):
                bound.setdefault(module_name, {})[key] = value.__name__
                continue
            classes[module_name][key] = value
            if value.__module__ != module_name:
                continue
            for attr, member in list(vars(value).items()):
                if callable(getattr(member, "__func__", member)) and _from_kvcached(member):
                    found = getattr(getattr(member, "__func__", member), "__dict__", {})
                    replaced[f"{module_name}.{key}.{attr}"] = sorted(
                        m for m, v in found.items() if v is True
                    )
    aliased = {key for names in bound.values() for key, cls in names.items() if key != cls}
    stale = {
        module_name: sorted(
            k
            for k, v in found_classes.items()
            if k in aliased and v.__name__ == k and v.__module__ != module_name
        )
        for module_name, found_classes in classes.items()
    }
    version = getattr(modules.get("sglang"), "__version__", None)
    pool = bound.get("sglang.srt.mem_cache.memory_pool", {}).get("MHATokenToKVPool")
    allocator = bound.get("sglang.srt.mem_cache.allocator", {}).get("PagedTokenToKVPoolAllocator")
    return {
        "sglang": version,
        "patched": bool(pool and allocator),
        "bound": bound,
        "stale": {k: v for k, v in stale.items() if v},
        "replaced": replaced,
        "marked": marked,
    }


def read_probes(prefix: str) -> list[dict[str, Any]]:
    """The probes the processes of one engine wrote (``prefix`` is its KVCACHED_BENCH_PROBE)."""
    base = pathlib.Path(prefix)
    found = []
    for path in sorted(base.parent.glob(f"{base.name}.*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return found


def summarize(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether kvcached's pool and allocator were in place in the scheduler process (the one whose
    function is SGLang's ``run_scheduler_process``), and in the engine's own process."""
    scheduler = [p for p in probes if "scheduler" in str(p.get("role", ""))]
    engine = [p for p in probes if p.get("role") == "engine"]
    return {
        "scheduler_patched": bool(scheduler) and all(p.get("patched") for p in scheduler),
        "engine_patched": bool(engine) and all(p.get("patched") for p in engine),
        "processes": len({p.get("pid") for p in probes}),
        "roles": sorted({str(p.get("role")) for p in probes}),
        "stale": sorted(
            {f"{m}.{k}" for p in scheduler for m, ks in p["stale"].items() for k in ks}
        ),
    }


def log_lines(log: pathlib.Path, limit: int = 40) -> list[str]:
    """What kvcached said in an engine's log about its patches and classes, each line once (the
    log has every process of the engine: SGLang's spawned ones write to the same file)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    said: dict[str, None] = {}
    for line in text.splitlines():
        if "kvcached" in line.lower() and any(n.lower() in line.lower() for n in LOG_NEEDLES):
            said.setdefault(line.strip()[:400])
    return list(said)[:limit]


def read_segment(name: str, shm_dir: pathlib.Path = SHM_DIR) -> dict[str, int] | None:
    """kvcached's segment for one engine (its group-0 pool; ``_g<N>`` for others): total, used
    and preallocated bytes; None while it is not there."""
    found: dict[str, int] | None = None
    for path in [shm_dir / name, *sorted(shm_dir.glob(f"{name}_g*"))]:
        try:
            raw = path.read_bytes()[:24]
        except OSError:
            continue
        if len(raw) < 24:
            continue
        total, used, prealloc = struct.unpack("<qqq", raw)
        found = found or {"total": 0, "used": 0, "prealloc": 0}
        found["total"] += total
        found["used"] += used
        found["prealloc"] += prealloc
    return found


class KvcachedSampler(threading.Thread):
    """The driver's view of kvcached engines' mapped KV (used + preallocated pages, GiB), from
    their segments, every 100 ms: samples like LedgerSampler's (``mapped_gib`` by engine)."""

    def __init__(self, segments: dict[str, str], period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.segments = segments  # engine name -> its KVCACHED_IPC_NAME
        self.period = period
        self.samples: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            mapped = {}
            for engine, name in self.segments.items():
                segment = read_segment(name)
                if segment is not None:
                    mapped[engine] = (segment["used"] + segment["prealloc"]) / GIB
            if mapped:
                self.samples.append({"wall": time.time(), "mapped_gib": mapped})

    def finish(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        self.join(5.0)
        return self.samples
