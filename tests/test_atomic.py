"""Temporary siblings of atomic outputs (graftlab.io.atomic): a rerun removes exactly the ones killed writers
on this host left, never a live writer's and never another host's, whatever the names."""

import os
import string

from conftest import dead_pid
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.io.atomic import HOST, KINDS, clean_stale

# Host names as SLURM nodes spell them, a dash included: `node1-b` must not pass for `node1`.
HOSTS = st.text(string.ascii_lowercase + string.digits + "-.", min_size=1, max_size=12)


@given(others=st.lists(HOSTS.filter(lambda h: h != HOST), min_size=1, max_size=4), kind=st.sampled_from(KINDS))
@settings(max_examples=50, deadline=None)
def test_a_rerun_removes_this_hosts_dead_writers_siblings_only(tmp_path_factory, others, kind):
    root = tmp_path_factory.mktemp("out")
    out, dead = root / "model", dead_pid()
    mine_dead = root / f".model.{kind}-{HOST}-{dead}"
    mine_alive = root / f".model.{kind}-{HOST}-{os.getpid()}"
    extended = root / f".model.{kind}-{HOST}-b-{dead}"  # a host named like ours plus a suffix
    theirs = [root / f".model.{kind}-{host}-{dead}" for host in others]  # their pid is dead here: no matter
    for path in (mine_dead, mine_alive, extended, *theirs):
        path.mkdir(exist_ok=True)
    assert clean_stale(out) == [mine_dead]
    assert not mine_dead.exists() and mine_alive.is_dir() and extended.is_dir()
    assert all(p.is_dir() for p in theirs)
