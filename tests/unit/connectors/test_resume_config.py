"""Resume settings (connectors/resume.py): checked when the config is built, and turned into
Ray Data's CheckpointConfig with the record kept after success."""
from __future__ import annotations

import pytest

from batchgen_data.connectors.resume import checkpoint_config
from batchgen_data.connectors.spark.resume import write_generated

ray = pytest.importorskip("ray")

from batchgen_data.connectors.ray.processor import BatchGenProcessorConfig  # noqa: E402


def test_checkpoint_config_keeps_the_record_so_a_finished_job_reruns_as_a_no_op(tmp_path):
    cfg = checkpoint_config(str(tmp_path / "ckpt"), "row_id")
    assert cfg.id_column == "row_id"
    assert cfg.checkpoint_path == str(tmp_path / "ckpt")
    assert cfg.delete_checkpoint_on_success is False


@pytest.mark.parametrize("kw,field", [({"resume_from": ""}, "resume_from"),
                                      ({"resume_from": "/tmp/x", "id_column": ""}, "id_column"),
                                      ({"resume_from": "/tmp/x", "id_column": 3}, "id_column")])
def test_bad_resume_settings_fail_when_the_config_is_built(kw, field):
    with pytest.raises(ValueError, match=field):
        BatchGenProcessorConfig(**kw)


def test_no_resume_by_default():
    assert BatchGenProcessorConfig().resume_from is None


def test_write_generated_needs_at_least_one_part():
    with pytest.raises(ValueError, match="parts=0"):
        write_generated(object(), "/tmp/out", "id", parts=0)
