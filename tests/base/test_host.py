"""rcgrpo.base.host: the memory the plan compares its need with (MemTotal
under a smaller cgroup limit) and the disk check."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from rcgrpo.base import host


def test_device_memory_bytes_on_cpu():
    total = host.device_memory_bytes("cpu")
    assert total > 1 << 30
    with open("/proc/meminfo") as f:
        memtotal = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert total <= memtotal
    with pytest.raises(ValueError, match="cuda or cpu"):
        host.device_memory_bytes("mps")


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A host of 64 GiB whose cgroup files are written by the test (v2 first)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemFree:  1024 kB\nMemTotal:  {64 << 20} kB\n")
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(host, "MEMINFO", str(meminfo))
    monkeypatch.setattr(host, "CGROUP_MEMORY_LIMITS", (str(v2), str(v1)))
    return SimpleNamespace(meminfo=meminfo, v2=v2, v1=v1)


def test_a_smaller_cgroup_limit_is_the_hosts_memory(fake_host):
    assert host.host_memory_bytes() == 64 << 30  # no limit file
    fake_host.v2.write_text("max\n")
    assert host.cgroup_memory_limit() is None
    assert host.host_memory_bytes() == 64 << 30
    fake_host.v2.write_text(f"{16 << 30}\n")
    assert host.host_memory_bytes() == host.device_memory_bytes("cpu") == 16 << 30
    fake_host.v2.write_text(f"{128 << 30}\n")  # larger than the machine: the machine's
    assert host.host_memory_bytes() == 64 << 30


def test_the_first_cgroup_file_that_reads_is_the_one_in_force(fake_host):
    fake_host.v1.write_text(f"{8 << 30}\n")
    assert host.host_memory_bytes() == 8 << 30  # v2 absent: v1
    fake_host.v2.write_text("max\n")
    assert host.host_memory_bytes() == 64 << 30  # v2 says no limit: v1 is not read


def test_meminfo_without_memtotal_is_an_error(fake_host):
    fake_host.meminfo.write_text("MemFree:  1024 kB\n")
    with pytest.raises(RuntimeError, match="no MemTotal"):
        host.host_memory_bytes()


def test_check_disk_refuses_what_the_nearest_existing_folder_cannot_hold(tmp_path, monkeypatch):
    seen = []

    def usage(path):
        seen.append(path)
        return SimpleNamespace(total=100 * host.GiB, used=90 * host.GiB, free=10 * host.GiB)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    host.check_disk(tmp_path / "a" / "b", int(9.5 * host.GiB), "a copy", "free some space")
    assert seen == [tmp_path]
    with pytest.raises(host.DiskPlanError, match=r"disk plan: a copy needs ~10\.5 GiB in .*b, the disk has "
                                                 r"10\.0 GiB free; free some space"):
        host.check_disk(tmp_path / "a" / "b", 10 * host.GiB, "a copy", "free some space")
