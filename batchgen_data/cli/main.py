"""`batchgen-data run INPUT -o OUTPUT`: a batch job from the shell.

    batchgen-data run requests.jsonl -o results.jsonl                  # OpenAI Batch in and out
    batchgen-data run prompts.parquet -o out.parquet --runner local    # a table in, a table out
    batchgen-data run requests.jsonl -o results.jsonl --resume --report run.html

The default runner is Ray (a local Ray, or the cluster RAY_ADDRESS names) when Ray is
installed, else `local`. docs/cli.md describes every flag and the file formats.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from batchgen_data.cli.inputs import ROW_KEY, InputFile, WorkItem, read_input
from batchgen_data.cli.outcome import Outcome, Runner
from batchgen_data.cli.outputs import (ENGINE_FAILED, RETRY_KEY, BatchOutput, LineLog,
                                       TableOutput, side_file)
from batchgen_data.cli.progress import Progress
from batchgen_data.cli.safe_files import OutputLock, refuse_input_as_output, write_text_nofollow
from batchgen_data.connectors.rows import OUTPUT_COLUMNS
from batchgen_data.openai.batch_output import error_line, success_line
from batchgen_data.report.record import RunRecord

RUNNERS = ("local", "ray", "spark")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgen-data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a batch file through the engine")
    run.add_argument("input", help="OpenAI Batch .jsonl, or a .jsonl/.parquet/.csv table with a "
                                   "prompt, messages or prompt_token_ids column")
    run.add_argument("-o", "--output", required=True, help="OpenAI Batch output .jsonl (batch "
                     "input) or .parquet/.jsonl/.csv (table input)")
    run.add_argument("--model", default=None, help="local model directory or cached hub id "
                     "(default: the embedded SmolLM2-135M-Instruct)")
    run.add_argument("--runner", choices=RUNNERS, default=None,
                     help="default: ray when installed, else local")
    run.add_argument("--actors", type=int, default=1, help="engines (Ray actors) to run")
    run.add_argument("--max-tokens", type=int, default=256,
                     help="max_tokens of a request that sets none (default 256)")
    run.add_argument("--report", default=None, help="write a self-contained HTML run report")
    run.add_argument("--resume", action="store_true",
                     help="skip requests already in OUTPUT (after a crash or a kill)")
    run.add_argument("--engine-kwargs", default="{}", type=json.loads,
                     help='engine arguments as JSON, vLLM names accepted: \'{"max_num_seqs": 64}\'')
    run.add_argument("--tensor-parallel-size", type=int, default=None,
                     help="devices (ranks) per engine, vLLM's tensor_parallel_size "
                          "(docs/parallel.md); same as --engine-kwargs '{\"tensor_parallel_size\": N}'")
    run.add_argument("--reasoning-parser", default=None,
                     help="split each answer from its reasoning (vLLM's reasoning_parser: "
                          "deepseek_r1, qwen3; docs/reasoning.md); same as --engine-kwargs "
                          "'{\"reasoning_parser\": NAME}'")
    run.add_argument("--tool-call-parser", default=None,
                     help="read tool calls out of answers (vLLM's tool_call_parser: hermes, "
                          "llama3_json, mistral, pythonic; docs/reasoning.md)")
    run.add_argument("--allowed-local-media-path", default=None,  # absolute: actors' cwd differs
                     type=lambda p: str(Path(p).absolute()),
                     help="the directory whose images requests may name by path or file:// URL "
                          "(vLLM's allowed_local_media_path; unset, no local file is read: "
                          "docs/multimodal.md)")
    run.add_argument("--progress-interval", type=float, default=None,
                     help="seconds between progress lines when stderr is not a terminal")
    return parser


def default_runner() -> str:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "local"
    return "ray"


def make_runner(args: argparse.Namespace, record: RunRecord) -> Runner:
    defaults = {"max_tokens": args.max_tokens}
    if args.runner == "local":
        from batchgen_data.cli.runner_local import LocalRunner

        return LocalRunner(args.model, dict(args.engine_kwargs), defaults, record)
    if args.runner == "ray":
        from batchgen_data.cli.runner_ray import RayRunner

        return RayRunner(args.model, dict(args.engine_kwargs), defaults, record, args.actors)
    from batchgen_data.cli.runner_spark import SparkRunner

    return SparkRunner(args.model, dict(args.engine_kwargs), defaults, record, args.actors)


class Job:
    """One run of the command: reads, skips what is done, runs the rest, writes as it goes.

    The output is checked not to be the input and locked against other runs before anything is
    opened for writing (cli/safe_files.py); the lock is held until `run` returns."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        for flag in ("reasoning_parser", "tool_call_parser",  # engine arguments by flag
                     "allowed_local_media_path"):
            if getattr(args, flag, None) is not None:
                args.engine_kwargs[flag] = getattr(args, flag)
        self.input: InputFile = read_input(args.input, args.max_tokens)
        out = Path(args.output)
        written = {"-o": out} if self.input.is_batch else {"-o": out, "-o's side file":
                                                             side_file(out)}
        if args.report:
            written["--report"] = Path(args.report)
        refuse_input_as_output(Path(args.input), written)
        if args.report:
            refuse_input_as_output(out, {"--report": Path(args.report)})
            if Path(args.report).is_symlink():  # refused now, not after the run
                raise ValueError(f"--report {args.report!r} is a symbolic link; the report "
                                 "is written without following links")
        self.lock = OutputLock(out)
        self.lock.acquire()
        try:
            self.output: LineLog = (BatchOutput(out, args.resume) if self.input.is_batch
                                    else TableOutput(out, args.resume))
        except BaseException:
            self.lock.release()
            raise
        self.engine_failed = 0  # requests the engine's death took with it (retried by --resume)
        self.todo = [i for i in self.input.items if i.key not in self.output.done]
        self.record = RunRecord(title=f"batchgen-data run {Path(args.input).name}")
        self.progress = Progress(self.input.total, self.input.total - len(self.todo),
                                 interval_s=args.progress_interval)
        self.runner: Runner | None = None
        self.model_name = args.model or "SmolLM2-135M-Instruct"

    def run(self) -> int:
        """Runs what is left; 0 when every request has its answer, 1 when some must run again
        (`--resume`): the engine died, or the runner failed."""
        try:
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> int:
        failed = [i for i in self.todo if i.error is not None]
        runnable = [i for i in self.todo if i.error is None]
        for item in failed:  # bad input lines: answered at once, nothing to run
            self.emit(Outcome(item, error=item.error, error_code=item.error_code))
        num_run = len(runnable)
        crashed: BaseException | None = None
        try:
            self._run_items(runnable)
        except Exception as e:  # noqa: BLE001 - what was written stays; --resume goes on
            traceback.print_exception(e)
            crashed = e
        self.record.end = time.time()
        complete = crashed is None and self.engine_failed == 0
        if isinstance(self.output, TableOutput) and complete:
            self.output.finish()
        else:  # a table is written whole only once every row has its answer
            self.output.close()
        self.progress.close()
        if self.args.report:
            from batchgen_data.report.html import render

            write_text_nofollow(Path(self.args.report), render(self.record))
        left = sum(1 for i in self.todo if i.key not in self.output.done)
        if not complete:
            why = (f"the run failed: {type(crashed).__name__}: {crashed}" if crashed is not None
                   else f"the engine died: {self.engine_failed} request(s) lost with it "
                        f"({ENGINE_FAILED})")
            sys.stderr.write(f"[batchgen] {why}; {left} request(s) still to run: run "
                             "the same command with --resume to run them\n")
            return 1
        sys.stderr.write(f"[batchgen] done: {num_run} run, {len(failed)} bad input, "
                         f"{self.input.total - len(self.todo)} already in {self.args.output}\n")
        return 0

    def _run_items(self, runnable: list[WorkItem]) -> None:
        pooling = [i for i in runnable if i.request is not None and i.request.pooling is not None]
        if pooling:  # /v1/embeddings, /v1/score, /v1/rerank lines: cli/runner_pooling.py
            from batchgen_data.cli.runner_pooling import PoolingRunner
            if self.args.runner != "local":
                sys.stderr.write(f"[batchgen] {len(pooling)} pooling line(s) run in this "
                                 "process (the pooling runner is local only)\n")
            PoolingRunner(self.args.model, dict(self.args.engine_kwargs),
                          self.model_name).run(pooling, self.emit_line)
            runnable = [i for i in runnable if i.request is None or i.request.pooling is None]
        if runnable:
            self.runner = make_runner(self.args, self.record)
            self.runner.run(runnable, self.emit)

    def emit(self, o: Outcome) -> None:
        if o.error_code == ENGINE_FAILED:
            self.engine_failed += 1
        self.output.write(self._line(o))
        self.progress.update(o.error is not None, o.generated_tokens)
        # the kind of an error, for the report, without the input line it happened on
        kind = None if o.error is None else re.sub(r"^line \d+: ", "", o.error)
        self.record.add_finished(o.actor, o.generated_tokens, kind)

    def emit_line(self, line: dict[str, Any], failed: bool) -> None:
        """A finished output line written as it is (the pooling lines')."""
        self.output.write(line)
        self.progress.update(failed, 0)
        kind = None if not failed else re.sub(r"^line \d+: ", "", line["error"]["message"])
        self.record.add_finished("local", 0, kind)

    def _line(self, o: Outcome) -> dict[str, Any]:
        item = o.item
        if item.request is None:
            return self._table_row(item, o)
        custom_id = item.request.custom_id
        if o.error is not None:
            return error_line(custom_id, o.error_code or "invalid_request", o.error)
        token_text = self.runner.token_text if self.runner is not None else None
        return success_line(custom_id or item.key, item.request.is_chat,
                            item.request.model or self.model_name, o.choices, o.prompt_tokens,
                            token_text)

    @staticmethod
    def _table_row(item: WorkItem, o: Outcome) -> dict[str, Any]:
        row = {k: v for k, v in item.row.items() if k not in OUTPUT_COLUMNS}
        c = o.choices[0] if o.choices else None
        row.update(generated_text=c.text if c else "",
                   generated_token_ids=list(c.token_ids) if c else [],
                   num_prompt_tokens=o.prompt_tokens if c else 0,
                   num_generated_tokens=len(c.token_ids) if c else 0,
                   finish_reason=c.finish_reason if c else None, error=o.error)
        row[ROW_KEY] = item.extra[ROW_KEY]
        if o.error_code == ENGINE_FAILED:
            row[RETRY_KEY] = True
        return row


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runner is None:
        args.runner = default_runner()
    if args.actors < 1:
        raise SystemExit(f"--actors={args.actors}: must be >= 1")
    if args.tensor_parallel_size is not None:
        if args.tensor_parallel_size < 1:
            raise SystemExit(f"--tensor-parallel-size={args.tensor_parallel_size}: must be >= 1")
        args.engine_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    try:
        job = Job(args)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"batchgen-data: {e}\n")
        return 2
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
