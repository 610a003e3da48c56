"""Hugging Face interchange for the LLaVA family (CLIP / SigLIP vision, Llama / Qwen2 /
Mistral text): :func:`config_from_hf`, :func:`load_hf`, :func:`save_hf`,
:func:`hf_batch`, and the checkpoint's two ways across (:func:`export_hf`,
:func:`import_hf`). ``transformers`` is imported only inside these functions (extra
``mp_bridge[hf]``); one name map (:mod:`.name_map`) serves every direction."""

from .hf_batch import hf_batch, pixel_patches
from .hf_config import config_from_hf
from .hf_export import export_hf
from .hf_import import import_hf
from .hf_load import load_hf
from .hf_save import save_hf
from .name_map import disk_to_module, hf_mappings, module_to_disk

__all__ = [
    "config_from_hf",
    "disk_to_module",
    "export_hf",
    "hf_batch",
    "hf_mappings",
    "import_hf",
    "load_hf",
    "module_to_disk",
    "pixel_patches",
    "save_hf",
]
