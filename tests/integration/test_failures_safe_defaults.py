"""Safe defaults: no remote code unless asked, no pickle weights ever, a clear error for a path
that is not a model directory, and no prompt text or secret in the logs at INFO and above."""
from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import wait
from pathlib import Path
from typing import Callable

import pytest
import torch

from batchgen_data import LLM, SamplingParams
from batchgen_data.connectors.common import RequestBuilder
from batchgen_data.connectors.rows import GenerationRows
from batchgen_data.engine.driver import EngineDriver

pytestmark = pytest.mark.timeout(300)

SECRET = "sk-live-TOPSECRET-4242"


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_trust_remote_code_is_off_by_default(tiny_model_dir: Callable[..., Path],
                                             tmp_path: Path) -> None:
    """A config that asks for its own Python code is refused, and that code never runs."""
    model = copy_model(tiny_model_dir("llama"), tmp_path / "remote")
    ran = tmp_path / "remote-code-ran"
    (model / "configuration_evil.py").write_text(
        f"open({str(ran)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="trust_remote_code"):
        LLM(str(model), max_model_len=32)
    assert not ran.exists()


def test_pickle_weights_are_refused(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    model = copy_model(tiny_model_dir("llama"), tmp_path / "pickled")
    for f in model.glob("*.safetensors"):
        f.unlink()
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"refusing the pickle checkpoint\(s\) "
                                         r"\['pytorch_model.bin'\]: loading pickle can run"):
        LLM(str(model), max_model_len=32)


@pytest.mark.parametrize("what", ["empty dir", "a weights file", "missing"])
def test_a_path_that_is_not_a_model_dir(tiny_model_dir: Callable[..., Path], tmp_path: Path,
                                        what: str) -> None:
    if what == "empty dir":
        path, match = tmp_path, "directory has no config.json"
    elif what == "a weights file":
        path = next(tiny_model_dir("llama").glob("*.safetensors"))
        match = "not a local model directory"
    else:
        path, match = tmp_path / "nowhere", "not a local model directory"
    with pytest.raises(ValueError, match=match):
        LLM(str(path), max_model_len=32)


def test_no_prompt_text_or_secret_in_logs(tiny_model_dir: Callable[..., Path],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Rows carrying a secret, good and bad, through the offline API and the row lifecycle:
    nothing logged at INFO or above quotes them (the `error` column may; logs are shared)."""
    model = str(tiny_model_dir("llama"))
    caplog.set_level(logging.DEBUG)
    llm = LLM(model, max_model_len=64)
    prompt = f"My API key is {SECRET}, keep it"
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    driver = EngineDriver(llm.engine)
    try:
        rows = GenerationRows(driver, RequestBuilder.from_engine(llm.engine, {"max_tokens": 4}),
                            0, "row")
        bad = [{"prompt": prompt, "sampling_params": {"temperature": -1}},
               {"prompt": f"   {SECRET}" * 40}, {"messages": [{"role": SECRET, "content": "x"}]}]
        futures = [rows.submit(r) for r in [{"prompt": prompt}, *bad]]
        wait(futures, timeout=120)
        outs = [rows.outcome(f) for f in futures]
    finally:
        driver.shutdown()
    assert outs[0]["error"] is None and all(o["error"] for o in outs[1:])
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not [r.getMessage() for r in loud if SECRET in r.getMessage()]
