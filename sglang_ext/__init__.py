"""SGLang extension: prefix caching for hybrid (attention + linear/SSM) LLMs.

Importing this package never imports SGLang; the launcher and the plugin do.
"""

__version__ = "0.1.0"

#: The only SGLang release this extension is built and tested against.
SUPPORTED_SGLANG_VERSION = "0.5.23"
