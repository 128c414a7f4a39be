"""Model loading: resolve a model name to a local folder (converting GGUF once), read its
config/tokenizer/weights, and build the model."""

from tandem.loader.gguf_convert import GGUFConversionError, convert_gguf
from tandem.loader.hf_folder import (
    SAMPLING_DEFAULT_FIELDS,
    SafetensorsSlice,
    TokenizerNotFoundError,
    get_eos_token_ids,
    has_tokenizer_files,
    iterate_weight_slices,
    iterate_weights,
    load_hf_config,
    load_tokenizer,
    sampling_defaults,
)
from tandem.loader.model_loader import (
    ModelNotFoundError,
    build_model,
    embedded_default_gguf,
    prepare_tokenizer,
    resolve_model_path,
)

__all__ = [
    "SAMPLING_DEFAULT_FIELDS",
    "GGUFConversionError",
    "ModelNotFoundError",
    "SafetensorsSlice",
    "TokenizerNotFoundError",
    "build_model",
    "convert_gguf",
    "embedded_default_gguf",
    "get_eos_token_ids",
    "has_tokenizer_files",
    "iterate_weight_slices",
    "iterate_weights",
    "load_hf_config",
    "load_tokenizer",
    "prepare_tokenizer",
    "resolve_model_path",
    "sampling_defaults",
]
