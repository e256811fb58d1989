"""The share ledger under what an outside review found (issue 18, defects 4-7 and the items found
by reading): who may own the file, fork(), non-ASCII names, huge timeouts, pid namespaces, slot
reuse and stale files. Real files in /dev/shm, real processes (fork, unshare), real users (root
changes the file's owner; a forked child drops to `nobody`).
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_ledger import LAYOUT, PAGE, Worker, wait_for

import kvasync
from kvasync import _core, _share_names, share
from kvasync.cli import main as cli

NOBODY = pwd.getpwnam("nobody")
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="changing a file's owner needs root")


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh share name; its ledger file (if any is left) is removed at the end."""
    chosen = f"test-{uuid.uuid4().hex[:12]}"
    yield chosen
    if os.path.lexists(share.path(chosen)):
        os.unlink(share.path(chosen))


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(prefix: tuple[str, ...] = ()) -> Worker:
        started.append(Worker("host", prefix))
        return started[-1]

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            os.kill(worker.proc.pid, signal.SIGCONT)  # a test may have stopped it
        worker.stop()


def join(share_name: str, member: str = "member") -> _core.ShareMember:
    return _share_names.join(share_name, member, 0, PAGE)


def in_child(body: Callable[[], object], timeout: float = 60.0) -> object:
    """Runs ``body`` in a forked child; returns what it returned (JSON) or raises what it raised."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # This process has threads (allocators' mappers and watchers): the child uses none of them.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            answer = {"ok": body()}
        except BaseException as error:  # reported to the parent, which raises it
            answer = {"error": f"{type(error).__name__}: {error}"}
        os.write(write_end, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([read_end], [], [], timeout)
            assert ready, f"the forked child {pid} did not answer within {timeout} s"
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    answer = json.loads(b"".join(chunks))
    if "error" in answer:
        raise AssertionError(f"in the child: {answer['error']}")
    return answer["ok"]


# -- defect 4: the file's owner and mode ---------------------------------------------------------


@needs_root
async def test_join_refuses_a_ledger_file_another_user_created_first(name: str) -> None:
    path = share.path(name)
    member = join(name)  # a valid ledger file, then given away as if `nobody` had made it
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    config = kvasync.Config(backend="host", max_blocks=16, share=name, device_budget=8 * PAGE)
    with pytest.raises(kvasync.KVAsyncError, match=r"refusing the ledger file .*owned by nobody"):
        await kvasync.Allocator.open(LAYOUT, config)
    with pytest.raises(kvasync.KVAsyncError, match=r"expected owned by root .*0600"):
        share.snapshot(name)
    with pytest.raises(kvasync.KVAsyncError, match="owned by nobody"):
        share.set_limit(name, os.getpid(), 8 * PAGE)
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)  # anyone could write it: lower limits, hold the lock
    with pytest.raises(kvasync.KVAsyncError, match=r"mode 0666; expected"):
        join(name)
    os.chmod(path, 0o600)
    assert len(share.snapshot(name)) == 1  # the operator's own file is accepted again
    member.leave_for_test()


def test_a_new_ledger_file_is_the_users_alone(name: str) -> None:
    member = join(name)
    st = os.stat(share.path(name))
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
    member.leave_for_test()


@needs_root
def test_another_user_cannot_open_a_users_share(name: str) -> None:
    member = join(name)

    def as_nobody() -> str:
        os.setgid(NOBODY.pw_gid)
        os.setuid(NOBODY.pw_uid)
        try:
            share.snapshot(name)
        except kvasync.KVAsyncError as error:
            return str(error)
        return "opened"

    assert "Permission denied" in str(in_child(as_nobody))
    member.leave_for_test()


@needs_root
def test_a_group_shares_a_device_between_users(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    group = grp.getgrgid(NOBODY.pw_gid)  # nobody's own group: nobody is a member of it
    monkeypatch.setenv(_share_names.SHARE_GROUP_ENV, group.gr_name)
    path = share.path(name)
    member = join(name)
    st = os.stat(path)
    assert (st.st_gid, st.st_mode & 0o777) == (group.gr_gid, 0o660)

    def nobody_joins() -> list[str]:
        os.setgid(NOBODY.pw_gid)
        os.setuid(NOBODY.pw_uid)
        theirs = join(name, "nobody's")
        names = [e.name for e in share.snapshot(name)]
        theirs.leave_for_test()
        return names

    assert in_child(nobody_joins) == ["member", "nobody's"]
    # A file of the group owned by one of its members (nobody) is accepted ...
    os.chown(path, NOBODY.pw_uid, group.gr_gid)
    assert [e.name for e in share.snapshot(name)] == ["member"]
    # ... one owned by a user outside the group is not, nor one that others may write.
    daemon = pwd.getpwnam("daemon")
    assert daemon.pw_gid != group.gr_gid and daemon.pw_name not in group.gr_mem
    os.chown(path, daemon.pw_uid, group.gr_gid)
    with pytest.raises(kvasync.KVAsyncError, match="owned by daemon"):
        share.snapshot(name)
    os.chown(path, 0, group.gr_gid)
    os.chmod(path, 0o666)
    with pytest.raises(kvasync.KVAsyncError, match="0666"):
        join(name)
    os.chmod(path, 0o660)
    # Without the variable, the group's file is not the user's alone: refused, with the way out.
    monkeypatch.delenv(_share_names.SHARE_GROUP_ENV)
    with pytest.raises(kvasync.KVAsyncError, match="KVASYNC_SHARE_GROUP"):
        share.snapshot(name)
    monkeypatch.setenv(_share_names.SHARE_GROUP_ENV, "no-such-group-kvasync")
    with pytest.raises(ValueError, match="names no group"):
        share.snapshot(name)
    monkeypatch.setenv(_share_names.SHARE_GROUP_ENV, group.gr_name)
    member.leave_for_test()


# -- defect 5: fork ------------------------------------------------------------------------------


async def test_a_forked_child_joins_anew_and_leaves_the_parents_entries_alone(name: str) -> None:
    config = kvasync.Config(
        backend="host", max_blocks=16, reserve_pages=(0, 0), share=name, device_budget=8 * PAGE
    )
    bare = join(name, "bare")
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        await kv.alloc(4)  # one page
        before = {(e.pid, e.name, e.committed_bytes) for e in share.snapshot(name)}

        def child() -> dict[str, object]:
            async def body() -> list[tuple[int, int]]:
                async with kvasync.open_allocator(LAYOUT, config) as own:
                    await own.alloc(4)
                    return [(e.pid, e.committed_bytes) for e in share.snapshot(name)]

            seen = asyncio.run(body())
            inherited = bare.owns_entry
            bare.leave_for_test()  # the parent's entry: leaving here must not clear it
            return {"pid": os.getpid(), "seen": seen, "inherited_owns": inherited}

        answer = in_child(child)
        assert isinstance(answer, dict)
        # The child's allocator had an entry of its own, charged with the page it mapped.
        assert [answer["pid"], PAGE] in answer["seen"]
        assert answer["inherited_owns"] is False
        after = {(e.pid, e.name, e.committed_bytes) for e in share.snapshot(name)}
        assert after == before and (os.getpid(), "bare", 0) in after
        assert bare.owns_entry
    bare.leave_for_test()


# -- defect 6: names -----------------------------------------------------------------------------


def test_a_long_non_ascii_name_is_cut_at_a_character_and_a_bad_byte_is_shown_replaced(
    name: str,
) -> None:
    member = join(name, "é" * 40)  # 80 bytes: 63 would end inside a character
    (entry,) = share.snapshot(name)
    assert entry.name == "é" * 31
    # A name another writer cut badly (or a stray byte) is shown, not a UnicodeDecodeError.
    path = Path(share.path(name))
    data = path.read_bytes()
    where = data.index("é".encode() * 31)
    with open(path, "r+b") as file:
        file.seek(where)
        file.write(b"\xff")
    (entry,) = share.snapshot(name)
    assert entry.name.startswith("\ufffd")
    listed = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["ls", "--share", name, "--json"])
    assert listed.exit_code == 0, listed.output
    member.leave_for_test()


# -- defect 7: timeouts --------------------------------------------------------------------------


def test_a_huge_timeout_waits_and_a_bad_one_is_refused_without_spoiling_the_lock(
    name: str,
) -> None:
    member = join(name)
    assert len(share.snapshot(name, timeout=1e10)) == 1
    assert share.set_limit(name, os.getpid(), 8 * PAGE, timeout=1e300) == 1
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            _core.ledger_snapshot(share.path(name), bad)
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            share.snapshot(name, timeout=bad)
    assert len(share.snapshot(name)) == 1  # the lock is as usable as before
    member.leave_for_test()


# -- liveness across pid namespaces, and slot reuse ----------------------------------------------

UNSHARE = ("unshare", "--pid", "--fork", "--kill-child")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30)
    return done.returncode == 0


def _child_pid(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root or user namespaces)")
def test_a_member_in_another_pid_namespace_lives_by_its_heartbeat_and_its_slot_is_safe(
    name: str, workers: Callable[..., Worker]
) -> None:
    worker = workers(UNSHARE)
    assert worker.pid == 1  # its own pid namespace: pid 1 there is another process here
    worker.call(cmd="open", share=name, budget=16 * PAGE, name="contained", reserve=(0, 0))
    worker.call(cmd="alloc", n=8)  # two pages charged
    (entry,) = share.snapshot(name)
    # Judged by pid, pid 1 here (with another start time) would be dead: reclaimed at once.
    assert entry.foreign and entry.name == "contained" and entry.committed_bytes == 2 * PAGE
    # Stopped, it stops beating: reclaimed once its heartbeat is older than kForeignStaleAfter.
    python = _child_pid(worker.proc.pid)
    os.kill(python, signal.SIGSTOP)
    wait_for(lambda: not share.snapshot(name), 20.0, "the stopped member's entry to be reclaimed")
    newcomer = join(name, "newcomer")  # takes the freed slot
    os.kill(python, signal.SIGCONT)
    # The resumed member finds its slot is not its own any more: it must neither release into
    # the newcomer's entry nor clear it when it closes.
    worker.call(cmd="free")
    worker.call(cmd="close")
    (entry,) = share.snapshot(name)
    assert (entry.name, entry.committed_bytes, entry.foreign) == ("newcomer", 0, False)
    assert newcomer.owns_entry
    newcomer.leave_for_test()


# -- stale files ---------------------------------------------------------------------------------


async def test_the_last_member_to_leave_removes_the_file(name: str) -> None:
    config = kvasync.Config(backend="host", max_blocks=16, share=name, device_budget=8 * PAGE)
    async with kvasync.open_allocator(LAYOUT, config) as first:
        await first.alloc(4)
        async with kvasync.open_allocator(LAYOUT, config):
            pass
        assert os.path.exists(share.path(name))  # `first` is still there
    assert not os.path.exists(share.path(name))
    async with kvasync.open_allocator(LAYOUT, config) as again:  # a new file, joined as usual
        await again.alloc(4)
        assert [e.committed_bytes > 0 for e in share.snapshot(name)] == [True]


RACER = """
import os, sys
from kvasync import _share_names, share
name, rounds = sys.argv[1], int(sys.argv[2])
mine = f"racer-{os.getpid()}"
for _ in range(rounds):
    member = _share_names.join(name, mine, 0, 1 << 21)
    # Joined the file at the path, never one its last member removed meanwhile.
    assert any(e.name == mine for e in share.snapshot(name)), "joined a removed file"
    member.leave_for_test()
print("done")
"""


def test_joiners_racing_the_last_leaver_always_land_in_the_file_at_the_path(name: str) -> None:
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, name, "150"], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    for racer in racers:
        out, _ = racer.communicate(timeout=120)
        assert racer.returncode == 0 and out.strip() == b"done"


def test_ls_prune_removes_the_files_of_shares_with_no_live_member(name: str) -> None:
    dead = name + "-dead"
    code = f"from kvasync import _share_names; m = _share_names.join({dead!r}, 'x', 0, 1 << 21)"
    subprocess.run(
        [sys.executable, "-c", code + "; import os; os._exit(0)"], check=True, timeout=60
    )
    assert os.path.exists(share.path(dead))  # it died without leaving
    live = join(name)
    runner = CliRunner()
    # One share at a time: other programs' shares on this machine are theirs to keep.
    pruned = runner.invoke(cli, ["ls", "--prune", "--share", dead])
    assert pruned.exit_code == 0 and f"{dead}: removed" in pruned.output, pruned.output
    kept = runner.invoke(cli, ["ls", "--prune", "--share", name])
    assert kept.exit_code == 0 and f"{name}: in use, kept" in kept.output, kept.output
    assert not os.path.exists(share.path(dead)) and os.path.exists(share.path(name))
    live.leave_for_test()


def test_ls_and_top_without_the_default_share_say_what_is_there(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVASYNC_SHARE", raising=False)
    # No device visible: the machine's default share is the host backend's, none here.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not os.path.exists(share.path("host"))
    member = join(name, "listed")
    runner = CliRunner(env={"COLUMNS": "200"})
    listed = runner.invoke(cli, ["ls"])
    assert listed.exit_code == 0, listed.output
    assert name in listed.output and "listed" in listed.output
    as_json = runner.invoke(cli, ["ls", "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert name in [s["share"] for s in json.loads(as_json.stdout)["shares"]]
    missing = runner.invoke(cli, ["ls", "--share", name + "-none"])
    assert missing.exit_code == 1 and "shares on this machine:" in missing.output
    assert name in missing.output
    member.leave_for_test()
    top = runner.invoke(cli, ["top", "--count", "2", "--interval", "0.05"])
    assert top.exit_code == 0, top.output
    shown = " ".join(top.output.split())  # rich wraps the line at the terminal's width
    assert "kvasync share 'host' (the default on a machine without CUDA: " in shown, shown
    assert "waiting for allocators to join" in shown


# -- issue 27: the ledger file under operators (defects 3, 5 and 8) -------------------------------

BLOCKS_PER_PAGE = 4  # share_worker.PAGE_SIZE holds 4 blocks of its layout
# A correctness bound, not a performance claim: a member re-registers within a watcher tick
# (100 ms) plus its scheduling delay (Note [Ledger file identity] in csrc/ledger/ledger.h).
REREGISTER_BOUND_S = 1.5


def committed_at_path(name: str) -> list[tuple[str, int]]:
    """(name, committed bytes) of each entry of the file now at the share's path; [] when none."""
    try:
        return [(e.name, e.committed_bytes) for e in share.snapshot(name)]
    except kvasync.KVAsyncError as error:
        if "No such file" not in str(error):  # gone at the open; it may be back by now
            raise
        return []


def poke_entry_state(path: str, slot: int, state: int) -> None:
    """Writes `state` into an entry's state word (its first 4 bytes), at the offsets the file's
    own header gives (header_bytes at byte 12, entry_bytes at byte 28)."""
    data = Path(path).read_bytes()
    header_bytes = int.from_bytes(data[12:16], "little")
    entry_bytes = int.from_bytes(data[28:32], "little")
    with open(path, "r+b") as file:
        file.seek(header_bytes + slot * entry_bytes)
        file.write(state.to_bytes(4, "little"))


def mapping_of(pid: int, path: str) -> tuple[int, int]:
    """The address range at which process `pid` maps the file `path` names."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith(" " + path):
            low, high = line.split()[0].split("-")
            return int(low, 16), int(high, 16)
    raise AssertionError(f"process {pid} does not map {path}")


def stop_with_its_watcher_parked(pid: int, path: str, timeout: float = 10.0) -> None:
    """Stops process `pid` (SIGSTOP) at a moment when its ledger watcher is parked in FUTEX_WAIT
    on the word in `path`'s mapping, between two ticks: then none of its threads is touching the
    file (the process is idle otherwise). Stopped mid-tick, it is continued and stopped again."""
    low, high = mapping_of(pid, path)
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout
    while True:
        os.kill(pid, signal.SIGSTOP)
        # Every thread stopped (state T) before their system calls are read.
        wait_for(
            lambda: all(
                (t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
                for t in tasks.iterdir()
            ),
            timeout,
            "every thread of the worker to stop",
        )
        for task in tasks.iterdir():
            call = (task / "syscall").read_text().split()
            # futex (202), or restart_syscall (219): a futex wait resumed after an earlier stop.
            if len(call) > 1 and call[0] in ("202", "219") and low <= int(call[1], 16) < high:
                return
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"the watcher of {pid} was never parked"
        time.sleep(0.005)  # a poll interval under a deadline: the next tick's wait


def maps_file(pid: int, path: str) -> bool:
    """Whether process `pid` has the file `path` names mapped (the kernel lists a removed file
    as `path (deleted)`)."""
    return any(
        line.endswith(" " + path) for line in Path(f"/proc/{pid}/maps").read_text().split("\n")
    )


def test_a_member_whose_file_is_removed_re_registers_its_pages_at_the_path(
    name: str, workers: Callable[..., Worker]
) -> None:
    member = workers()
    member.call(cmd="open", share=name, budget=16 * PAGE, name="a", reserve=(0, 0))
    member.call(cmd="alloc", n=12 * BLOCKS_PER_PAGE)
    path = share.path(name)
    removed = os.stat(path).st_ino
    os.unlink(path)  # an operator's rm, or systemd's RemoveIPC at logout
    took = wait_for(
        lambda: committed_at_path(name) == [("a", 12 * PAGE)],
        REREGISTER_BOUND_S,
        "the member's 12 pages in a file at the path again",
    )
    assert os.stat(path).st_ino != removed, took
    # It let go of the removed file, and it keeps serving in the new one.
    assert not maps_file(member.pid, path + " (deleted)") and maps_file(member.pid, path)
    member.call(cmd="free")
    wait_for(lambda: committed_at_path(name) == [("a", 0)], 5.0, "its release in the new file")
    member.call(cmd="alloc", n=16 * BLOCKS_PER_PAGE)
    member.call(cmd="close")
    assert not os.path.exists(path)  # the last member out removes the new file too


def test_a_joiner_after_the_file_was_removed_never_takes_the_pages_its_members_hold(
    name: str, workers: Callable[..., Worker]
) -> None:
    # Issue 27, defect 3: A held 12 of 16 pages; the file was removed; B joined, made a fresh
    # ledger and mapped 12 more: 24 pages against 16.
    first, second = workers(), workers()
    first.call(cmd="open", share=name, budget=16 * PAGE, name="a", reserve=(0, 0))
    first.call(cmd="alloc", n=12 * BLOCKS_PER_PAGE)
    os.unlink(share.path(name))
    second.call(cmd="open", share=name, budget=16 * PAGE, name="b", reserve=(0, 0))
    second.send(cmd="alloc", n=12 * BLOCKS_PER_PAGE, timeout=1.0)
    answer = second.read(10.0)
    assert not answer["ok"] and "AllocTimeout" in answer["error"], answer
    assert "budget" in answer["error"], answer["error"]
    # What the budget leaves B is still granted.
    assert second.call(cmd="alloc", n=4 * BLOCKS_PER_PAGE)["got"] == 4 * BLOCKS_PER_PAGE
    assert sorted(committed_at_path(name)) == [("a", 12 * PAGE), ("b", 4 * PAGE)]


def test_a_truncated_ledger_file_is_a_clear_error_for_an_idle_member_and_everyone_else(
    name: str, workers: Callable[..., Worker]
) -> None:
    member = workers()
    member.call(cmd="open", share=name, budget=16 * PAGE, name="a", reserve=(0, 0))
    member.call(cmd="alloc", n=2 * BLOCKS_PER_PAGE)
    path = share.path(name)
    # Note [Ledger file identity]: truncation is noticed when it lands while the member is idle,
    # as here; one racing a touch (its own watcher's tick included) faults with SIGBUS.
    stop_with_its_watcher_parked(member.pid, path)
    os.truncate(path, 0)
    os.kill(member.pid, signal.SIGCONT)
    # Its watcher checks the size before its tick touches the file, and lets go of it: the
    # process maps it no more (a touch would have been a SIGBUS).
    wait_for(lambda: not maps_file(member.pid, path), REREGISTER_BOUND_S, "the member to let go")
    member.send(cmd="alloc", n=4 * BLOCKS_PER_PAGE, timeout=0.5)
    answer = member.read(10.0)
    assert not answer["ok"] and "truncated" in answer["error"], answer
    for refused in (lambda: join(name), lambda: share.snapshot(name)):
        with pytest.raises(kvasync.KVAsyncError, match=r"truncated \(0 bytes"):
            refused()
    # Removed (as the message says), the file is made anew with the member's pages in it.
    os.unlink(path)
    wait_for(
        lambda: committed_at_path(name) == [("a", 2 * PAGE)],
        REREGISTER_BOUND_S,
        "the member's 2 pages in a new file",
    )
    assert member.call(cmd="alloc", n=4 * BLOCKS_PER_PAGE)["got"] == 4 * BLOCKS_PER_PAGE


async def test_a_ledger_with_an_invalid_entry_state_is_refused_everywhere(name: str) -> None:
    # Issue 27, defect 5: allocators joined and allocated while `snapshot` and `kvasync ls`
    # called the same file corrupt, and the file outlived its last member.
    path = share.path(name)
    member = join(name, "held")  # slot 0, live
    poke_entry_state(path, 0, 2)
    config = kvasync.Config(backend="host", max_blocks=16, share=name, device_budget=8 * PAGE)
    message = r"is corrupt: entry 0 has state 2"
    with pytest.raises(kvasync.KVAsyncError, match=message):
        join(name, "joiner")
    with pytest.raises(kvasync.KVAsyncError, match=message):
        await kvasync.Allocator.open(LAYOUT, config)
    with pytest.raises(kvasync.KVAsyncError, match=message):
        share.snapshot(name)
    with pytest.raises(kvasync.KVAsyncError, match=message):
        share.set_limit(name, os.getpid(), 8 * PAGE)
    with pytest.raises(kvasync.KVAsyncError, match=message):
        share.prune(name)
    runner = CliRunner(env={"COLUMNS": "200"})
    listed = runner.invoke(cli, ["ls", "--share", name])
    assert listed.exit_code == 1 and "entry 0 has state 2" in listed.output, listed.output
    pruned = runner.invoke(cli, ["ls", "--prune", "--share", name])
    assert pruned.exit_code == 1 and "kept" in pruned.output, pruned.output
    assert os.path.exists(path)
    # Whole again, the same file is used by all as before.
    poke_entry_state(path, 0, 1)
    assert [e.name for e in share.snapshot(name)] == ["held"]
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        await kv.alloc(4)
    member.leave_for_test()
    assert not os.path.exists(path)


async def test_a_member_charges_nothing_from_a_ledger_that_turned_corrupt(name: str) -> None:
    path = share.path(name)
    config = kvasync.Config(
        backend="host", max_blocks=16, reserve_pages=(0, 0), share=name, device_budget=8 * PAGE
    )
    async with kvasync.open_allocator(LAYOUT, config) as kv:
        kv.free(await kv.alloc(4))
        await kv.trim()
        bystander = join(name, "bystander")  # slot 1
        poke_entry_state(path, 1, 3)
        with pytest.raises(kvasync.AllocTimeout, match="entry 1 has state 3"):
            await kv.alloc(4, timeout=0.5)
        poke_entry_state(path, 1, 1)
        assert len(await kv.alloc(4, timeout=5.0)) == 4
        bystander.leave_for_test()


@pytest.mark.parametrize("mode", [0o400, 0o700, 0o200, 0o000, 0o1600, 0o4600, 0o660])
def test_a_users_ledger_file_is_accepted_at_mode_0600_only(name: str, mode: int) -> None:
    # Issue 27, defect 8: 0400 and 0700 were accepted; the documented rule is 0600.
    path = share.path(name)
    member = join(name)
    os.chmod(path, mode)
    expected = rf"mode {mode:04o}; expected .*\(mode 0600\)"
    with pytest.raises(kvasync.KVAsyncError, match=expected):
        share.snapshot(name)
    with pytest.raises(kvasync.KVAsyncError, match=expected):
        join(name, "joiner")
    os.chmod(path, 0o600)
    assert len(share.snapshot(name)) == 1
    member.leave_for_test()


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o620, 0o670, 0o2660])
def test_a_groups_ledger_file_is_accepted_at_mode_0660_only(
    name: str, mode: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With KVASYNC_SHARE_GROUP the documented rule is 0660 (the user's own group works for any
    # user: no root needed).
    monkeypatch.setenv(_share_names.SHARE_GROUP_ENV, grp.getgrgid(os.getegid()).gr_name)
    path = share.path(name)
    member = join(name)
    assert os.stat(path).st_mode & 0o7777 == 0o660
    os.chmod(path, mode)
    with pytest.raises(kvasync.KVAsyncError, match=rf"mode {mode:04o}; expected .*\(mode 0660\)"):
        share.snapshot(name)
    os.chmod(path, 0o660)
    assert len(share.snapshot(name)) == 1
    member.leave_for_test()
