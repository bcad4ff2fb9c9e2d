"""ProgramAdmission: programs start while their expected KV fits the pool share; the estimate
is cold (a multiple of the first step) until programs end, then their mean peak."""
from __future__ import annotations

import pytest

from batchgen_data.programs.admission import COLD_OUTPUT_TOKENS, ProgramAdmission


def test_step_blocks_counts_the_prompt_once_and_every_output() -> None:
    adm = ProgramAdmission(num_blocks=100, block_size=4)
    assert adm.step_blocks([10], [6]) == 4 + 1  # 16 tokens, one partial block
    assert adm.step_blocks([10, 12], [6, 6]) == 6 + 2  # 12 + 12 tokens: a fan-out
    assert adm.expected_output(10_000) == COLD_OUTPUT_TOKENS
    adm.step_done(3)
    adm.step_done(6)
    assert adm.expected_output(10_000) == 5 and adm.expected_output(2) == 2


def test_programs_start_while_their_expected_peaks_fit() -> None:
    adm = ProgramAdmission(num_blocks=100, block_size=4, fill=1.0, cold_growth=3.0)
    assert adm.may_start()  # nothing in flight: always
    adm.reserve("a", 10)  # cold: expected to reach 30
    assert adm.may_start()
    adm.reserve("b", 10)
    adm.reserve("c", 10)
    assert not adm.may_start() and adm.in_flight == 3  # 3 x 30 + 30 > 100
    adm.reserve("a", 25)
    adm.end("a")  # its peak, 25, is now the estimate for every program
    assert adm.num_ended == 1 and adm.in_flight == 2
    assert adm.may_start()  # 25 + 25 + 25 <= 100
    adm.reserve("d", 12)
    adm.reserve("e", 40)  # above the estimate: it reserves what it needs
    assert not adm.may_start()  # 25 + 25 + 25 + 40 > 100
    adm.end("e", completed=False)  # moved away: teaches nothing
    assert adm.num_ended == 1 and adm.may_start() and adm.max_in_flight == 4


def test_admission_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="fill"):
        ProgramAdmission(10, 4, fill=0.0)
    with pytest.raises(ValueError, match="cold_growth"):
        ProgramAdmission(10, 4, cold_growth=0.5)
