"""The git commit and dirty flag that the bench and lab records carry (``ropelib._provenance.git_state``)."""

import subprocess

import pytest

from ropelib import _provenance as provenance_module


def test_git_state_names_this_checkout():
    state = provenance_module.git_state()
    if state["git_commit"] == "unknown":  # an installed package, or no git here
        pytest.skip("ropelib is not run from a git checkout here")
    assert len(state["git_commit"]) == 40 and int(state["git_commit"], 16) >= 0
    assert isinstance(state["git_dirty"], bool)


def test_git_state_is_unknown_outside_a_checkout(tmp_path):
    assert provenance_module.git_state(tmp_path) == {"git_commit": "unknown", "git_dirty": "unknown"}


def test_git_state_is_unknown_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert provenance_module.git_state() == {"git_commit": "unknown", "git_dirty": "unknown"}


def test_records_carry_the_git_state():
    import torch

    from ropelib.bench.cli import environment
    from ropelib.lab.experiment import provenance

    for record in (environment(torch.device("cpu")), provenance("python -m ropelib.lab", "cpu")):
        assert {"git_commit", "git_dirty"} <= record.keys()
