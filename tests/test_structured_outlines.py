"""outlines, unmodified, on shmvllm: `outlines.from_vllm_offline` builds vLLM's
SamplingParams(structured_outputs=StructuredOutputsParams(...)) for a pydantic model, a regex and
a Literal choice, and every answer fits. Needs outlines (`-m clients`, installed apart)."""

from __future__ import annotations

import json
import re
import sys
from typing import Literal

import pytest

pytestmark = pytest.mark.clients



def _as_vllm() -> None:
    """`import vllm` resolves to shmvllm: the drop-in's install_as_vllm where it exists, else
    the two modules outlines imports."""
    import shmvllm

    if hasattr(shmvllm, "install_as_vllm"):
        shmvllm.install_as_vllm()
        return
    import shmvllm.sampling_params

    sys.modules.setdefault("vllm", shmvllm)
    sys.modules.setdefault("vllm.sampling_params", shmvllm.sampling_params)


def _city_model() -> type:
    """The pydantic model of the JSON test (built here: the module is collected without pydantic
    and outlines where the clients marker is deselected)."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population_millions: float = pydantic.Field(ge=0, le=50)
        landmarks: list[str] = pydantic.Field(min_length=1, max_length=3)

    return City


@pytest.fixture(scope="module")
def model():
    outlines = pytest.importorskip("outlines")
    pytest.importorskip("xgrammar")
    _as_vllm()
    from shmvllm import LLM

    with LLM(max_model_len=1024) as llm:
        yield outlines.from_vllm_offline(llm)


def test_pydantic_model_json(model):
    from shmvllm import SamplingParams

    City = _city_model()
    text = model("Describe Paris as JSON.", City, sampling_params=SamplingParams(temperature=0.0, max_tokens=200))
    city = City.model_validate(json.loads(text))
    assert city.name


def test_regex_and_literal_choice(model):
    from outlines.types import Regex

    from shmvllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    date = model("When did the Berlin wall fall? Give the date.", Regex(r"\d{4}-\d{2}-\d{2}"), sampling_params=greedy)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), date
    mood = model("Is this review positive or negative? 'I loved it.'", Literal["positive", "negative"], sampling_params=greedy)
    assert mood in ("positive", "negative")
    batch = model.batch(["Name a colour.", "Name a fruit."], Literal["red", "apple", "other"], sampling_params=greedy)
    assert len(batch) == 2 and all(len(answers) == 1 and answers[0] in ("red", "apple", "other") for answers in batch)
