"""`--set STEP.key=value` on a data step names the stage's fields, not the StageInput wrapper."""

import pytest

from keel.core.errors import ConfigError
from keel.data.dedup import ExactDedupConfig, run_exact_dedup
from keel.data.filter import FilterConfig, run_filter
from keel.data.steps import data_step
from keel.steps import output_of
from keel.steps.experiment import override_steps


def _steps():
    exact = data_step("exact_dedup", run_exact_dedup, "raw/*.parquet", ExactDedupConfig())
    return exact, data_step("filter", run_filter, output_of(exact), FilterConfig())


def test_a_data_steps_keys_are_its_stages_fields_and_input():
    exact, kept = _steps()
    (changed,) = override_steps([kept], ["filter.min_word_count=400", "filter.languages=null"])
    assert changed.config.stage.min_word_count == 400 and changed.config.stage.languages is None
    assert changed.config.input == kept.config.input and changed.identity != kept.identity
    (moved,) = override_steps([exact], ["exact_dedup.input=other/*.parquet"])
    assert moved.config.input == "other/*.parquet" and moved.config.stage == exact.config.stage


def test_the_old_wrapped_key_is_refused_with_the_new_one():
    _, kept = _steps()
    with pytest.raises(ConfigError) as error:
        override_steps([kept], ["filter.stage.min_word_count=400"])
    assert str(error.value) == (
        "--set filter.stage.min_word_count=400: a data step's keys are its stage's fields now; "
        "use --set filter.min_word_count=400"
    )
    with pytest.raises(ConfigError, match="no_such_field"):
        override_steps([kept], ["filter.no_such_field=1"])
