"""The CPUs a worker may keep busy: its affinity, capped by a cgroup CPU quota (v2 or v1), the
lowest on the way from its group up to the root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import cpus
from engine.cpus import cgroup_quota, cpu_budget, parse_cfs, parse_cpu_max


def test_cpu_max_reads_a_quota_or_none():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    for junk in ("", "max", "abc 100000", "100000 0", "-1 100000", "1 2 3"):
        assert parse_cpu_max(junk) is None


def test_cfs_reads_a_quota_or_none():
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("50000\n", "100000\n") == 0.5
    assert parse_cfs("", "100000") is None




def _group(root: Path, rel: str, **files: str) -> None:
    group = root / rel
    group.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (group / name.replace("__", ".")).write_text(text)


def test_v2_takes_the_lowest_quota_from_the_group_up_to_the_root(tmp_path: Path):
    _group(tmp_path, "", cpu__max="max 100000\n")
    _group(tmp_path, "kubepods/pod1", cpu__max="400000 100000\n")
    _group(tmp_path, "kubepods/pod1/ctr", cpu__max="250000 100000\n")
    assert cgroup_quota("0::/kubepods/pod1/ctr\n", tmp_path) == 2.5
    _group(tmp_path, "kubepods", cpu__max="100000 100000\n")
    assert cgroup_quota("0::/kubepods/pod1/ctr\n", tmp_path) == 1.0


def test_v2_in_a_container_reads_its_namespace_root(tmp_path: Path):
    _group(tmp_path, "", cpu__max="200000 100000\n")
    assert cgroup_quota("0::/\n", tmp_path) == 2.0


def test_v1_reads_the_cpu_controllers_quota(tmp_path: Path):
    _group(tmp_path, "cpu,cpuacct/docker/abc", cpu__cfs_quota_us="300000\n",
           cpu__cfs_period_us="100000\n")  # fmt: skip
    text = "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_quota(text, tmp_path) == 3.0


def test_no_quota_anywhere_is_none(tmp_path: Path):
    _group(tmp_path, "cpu", cpu__cfs_quota_us="-1\n", cpu__cfs_period_us="100000\n")
    assert cgroup_quota("1:cpu:/\n0::/\n", tmp_path) is None
    assert cgroup_quota("", tmp_path) is None


def test_a_path_that_climbs_out_stops_at_the_mount(tmp_path: Path):
    _group(tmp_path, "", cpu__max="100000 100000\n")
    (tmp_path.parent / "cpu.max").write_text("50000 100000\n")  # outside the mount: not read
    assert cgroup_quota("0::/../..\n", tmp_path) == 1.0


@given(st.text(max_size=200))
def test_any_proc_cgroup_text_gives_a_quota_or_none(text: str):
    quota = cgroup_quota(text, Path("/nonexistent-cgroup-root"))
    assert quota is None


@pytest.mark.parametrize(("affinity", "quota", "expected"), [
    (2, None, 2), (16, 2.0, 2), (16, 1.5, 1), (16, 0.5, 1), (1, 4.0, 1),
])  # fmt: skip
def test_the_budget_is_the_affinity_capped_by_the_quota(monkeypatch, affinity, quota, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(cpus, "cgroup_quota", lambda text: quota)
    assert cpu_budget() == expected


def test_the_budget_follows_this_process_affinity():
    assert 1 <= cpu_budget() <= len(os.sched_getaffinity(0))
