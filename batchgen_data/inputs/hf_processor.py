"""A model directory's HF processor, as the inputs pipeline uses it: for images only.

`AutoProcessor` builds every sub-processor a family declares; the Qwen-VL families declare a
video processor that needs torchvision, so without torchvision `AutoProcessor` raises
ImportError although images need none of it. Then the processor is put together from its image
processor (`AutoImageProcessor`: the PIL backend), its tokenizer (with the chat template) and
the family's processor class, with no video processor: its image-token expansion
(`replace_image_token`) and call are the HF class's own.
"""
from __future__ import annotations

from typing import Any


def load_processor(model: str, trust_remote_code: bool = False) -> Any | None:
    """The directory's HF processor when it has an image processor, else None (a text-only
    model)."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except ImportError:  # a sub-processor needs a library images do not (torchvision)
        proc = _images_only(model, trust_remote_code)
    except (OSError, ValueError, KeyError):  # no processor files: a text-only model
        return None
    return proc if getattr(proc, "image_processor", None) is not None else None


def _images_only(model: str, trust_remote_code: bool) -> Any | None:
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        return None
    images = AutoImageProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    proc = cls.__new__(cls)
    check = proc.check_argument_for_proper_class

    def lenient(attribute: str, value: Any) -> Any:
        """An absent sub-processor (the video one) is not checked against its class, which
        cannot be imported here."""
        return None if value is None else check(attribute, value)

    proc.check_argument_for_proper_class = lenient  # this instance's construction only
    try:
        cls.__init__(proc, image_processor=images, tokenizer=tokenizer,
                     chat_template=getattr(tokenizer, "chat_template", None))
    finally:
        del proc.check_argument_for_proper_class
    return proc
