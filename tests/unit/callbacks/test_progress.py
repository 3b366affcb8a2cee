"""What a run shows while it works: a bar that counts optimizer steps, and log lines around the long waits."""

import json
import logging

import pytest

from lightning_logra.base.waits import waiting_for
from lightning_logra.data.prompts import PromptDataset


def test_a_wait_is_announced_and_its_duration_logged(caplog):
    log = logging.getLogger("lightning_logra.test")
    with caplog.at_level(logging.INFO, logger="lightning_logra"):
        with waiting_for("starting the engine", log):
            assert [r.getMessage() for r in caplog.records] == ["starting the engine ..."]  # before the wait ends
        with pytest.raises(RuntimeError), waiting_for("loading the model", log):
            raise RuntimeError("no such model")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1].startswith("starting the engine: done in ") and messages[1].endswith(" s")
    assert messages[2] == "loading the model ..."
    assert messages[3].startswith("loading the model: failed after ")


def test_loading_prompts_is_announced(tmp_path, caplog):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(3)))
    with caplog.at_level(logging.INFO, logger="lightning_logra"):
        PromptDataset(str(path))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"loading prompts for data.train from {path} ..."
    assert messages[1].startswith(f"loading prompts for data.train from {path}: done in ")
