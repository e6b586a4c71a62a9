"""The names of the locally built models, free of mlx: the CLI offers them as choices
in an image without mlx, and arch_models builds them."""

# mlx-lm families arch_models builds, in the order its tables list them.
ARCHES = ("qwen3", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "mamba2", "falcon_h1")
# Vision-language families vision_models builds.
VISION_FAMILIES = ("gemma3", "mistral3")
