"""A finished job's working tree removed with the folders it leaves empty (`graftlab.io.atomic.remove_tree`),
while other jobs finish beside it: two jobs on one node share the folders above their trees."""

import os
from pathlib import Path

from graftlab.io.atomic import remove_tree


def test_the_folders_left_empty_go_and_a_shared_one_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (Path("resume/results/x/a") / "state").mkdir(parents=True)
    (Path("resume/results/y/b")).mkdir(parents=True)
    remove_tree("resume/results/x/a")
    assert not Path("resume/results/x").exists() and Path("resume/results/y/b").is_dir()
    remove_tree("resume/results/y/b")
    assert os.listdir(tmp_path) == []


def test_a_folder_another_job_removes_or_fills_meanwhile_ends_the_walk(tmp_path, monkeypatch):
    """The other job's step lands between this one's look and its removal: no error either way."""
    monkeypatch.chdir(tmp_path)
    Path("resume/results/x/a").mkdir(parents=True)
    rmdir = Path.rmdir

    def raced(self):
        if self == Path("resume/results"):
            rmdir(self)  # the other job removed it first
        return rmdir(self)

    monkeypatch.setattr(Path, "rmdir", raced)
    remove_tree("resume/results/x/a")
    assert not Path("resume/results").exists() and Path("resume").is_dir()
    Path("resume/results/x/a").mkdir(parents=True)

    def filled(self):
        if self.name == "x":
            (self / "new").mkdir()  # another job's tree appears in x first
        return rmdir(self)

    monkeypatch.setattr(Path, "rmdir", filled)
    remove_tree("resume/results/x/a")
    assert Path("resume/results/x/new").is_dir()
