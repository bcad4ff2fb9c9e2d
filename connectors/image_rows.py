"""A generation row's images: its `image` / `images` columns and image content parts, through
the model's image pipeline (`batchgen_data/inputs/images.py`), into the request's token ids
and `mm_inputs`. Every way an image can be wrong is the row's error (`RowError`, the reason
from the pipeline), never the job's; docs/multimodal.md lists them."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from batchgen_data.connectors.cells import to_python
from batchgen_data.connectors.handler import RowError
from batchgen_data.inputs.image_input import ImageInput
from batchgen_data.inputs.image_parts import IMAGE_COLUMNS, TEXT_ONLY, column_images, text_only
from batchgen_data.inputs.images import ImagePreparer
from batchgen_data.inputs.prompt_checks import check_prompt_text


def image_cell(value: Any) -> Any:
    """An image cell as plain Python, but an image array (`ray.data.read_images`' HWC uint8)
    kept as the array it is: as nested lists it would be a Python int per pixel."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        if value.dtype == object:  # a list column that pandas holds as an object array
            return [image_cell(v) for v in value]
        return list(value) if value.ndim == 4 else value  # a stack of images: a list of them
    if isinstance(value, (list, tuple)):
        return [image_cell(v) for v in value]
    return to_python(value)


def column_images_of(row: Mapping[str, Any]) -> list[Any]:
    """The images of a row's image columns, in order; RowError for a malformed cell."""
    try:
        return column_images({c: image_cell(row.get(c)) for c in IMAGE_COLUMNS})
    except ValueError as e:
        raise RowError(str(e)) from None


def prompt_with_images(images: Callable[[], ImagePreparer | None],
                       encode_text: Callable[[Any], tuple[list[int], Any]], column: str,
                       value: Any, column_images: list[Any], chat: Mapping[str, Any],
                       apply_chat_template: bool
                       ) -> tuple[list[int], str, tuple[ImageInput, ...]]:
    """(prompt_token_ids, prompt, images) of a row whose prompt sits in `column`; a text-only
    model reads a message's text parts (`encode_text`: the row's usual rendering) and refuses
    its images."""
    if column == "prompt_token_ids":
        raise RowError("an image column needs a prompt or messages: prompt_token_ids are "
                       "sent as given")
    prep = images()
    try:
        if prep is None:
            if column_images:
                raise ValueError(f"the row's image column holds {len(column_images)} "
                                 f"image(s): {TEXT_ONLY}")
            return (*encode_text(text_only(value)), ())
        if column == "messages":
            ready = prep.submit_chat(value, column_images, True, **chat).result()
        else:
            ready = prep.submit_prompt(check_prompt_text(value), column_images,
                                       apply_chat_template, **chat).result()
    except (TypeError, ValueError) as e:
        raise RowError(str(e)) from None
    return ready.prompt_token_ids, ready.prompt, ready.images


def images_kwargs(images: tuple[ImageInput, ...]) -> dict[str, Any]:
    """`mm_inputs=` for a driver's submit when the row has images (drivers faked at the
    connectors' seam need not know the argument otherwise)."""
    return {"mm_inputs": list(images)} if images else {}
