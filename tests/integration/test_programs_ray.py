"""Per-row programs on a local 2-CPU Ray with a tiny random Llama: each example's rows, through
`BatchGenPredictor(program=...)` or `build_processor`, equal its steps run by hand with
`LLM.chat`; a row whose program breaks gets an error and the others go on."""
from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from batchgen_data import LLM  # noqa: E402
from batchgen_data.connectors.ray_data import (  # noqa: E402
    BatchGenPredictor, BatchGenProcessorConfig, build_processor)

from program_refs import EXAMPLES, example, rows_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ENGINE = {"max_model_len": 256, "max_num_seqs": 16, "block_size": 4}
DEFAULTS = {"max_tokens": 6}


def shipped(name: str) -> Any:
    """The example's program, with its module pickled by value (workers cannot import it)."""
    mod = example(name)
    ray.cloudpickle.register_pickle_by_value(mod)
    return getattr(mod, EXAMPLES[name][0])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_on_ray_equal_their_steps_by_hand(ray_local: None, model: str, llm: LLM,
                                                   name: str) -> None:
    prog, by_hand = shipped(name), EXAMPLES[name][1]
    rows = [{"id": i, **row} for i, row in enumerate(rows_for(name))]
    if name == "programs_revise":  # through build_processor, with a row the program cannot read
        config = BatchGenProcessorConfig(model_source=model, concurrency=1, batch_size=2,
                                         engine_kwargs=ENGINE, sampling_params=DEFAULTS,
                                         program=prog)
        bad = {"id": 99, "question": None}
        got = build_processor(config)(ray.data.from_items(rows + [bad])).take_all()
    else:
        out = ray.data.from_items(rows).map_batches(
            BatchGenPredictor, batch_size=2, batch_format="pyarrow",
            fn_constructor_kwargs=dict(model=model, sampling_params=DEFAULTS, program=prog,
                                       migration=False, **ENGINE),
            compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=2),
            num_cpus=0.5)
        got = out.take_all()
    by_id = {r["id"]: r for r in got}
    want = by_hand(llm, rows_for(name), DEFAULTS["max_tokens"])
    columns = prog.schema.names
    for row, ref in zip(rows, want):
        out = by_id[row["id"]]
        assert out["error"] is None, out["error"]
        assert {c: _plain(out[c]) for c in columns} == ref
        assert out["question"] == row["question"]  # input columns pass through
    if name == "programs_revise":
        assert len(got) == len(rows) + 1
        assert "step 1: messages[0] needs string" in by_id[99]["error"]
        assert by_id[99]["answer"] is None


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value
