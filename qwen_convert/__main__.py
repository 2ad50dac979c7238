"""``python -m qwen_convert`` is ``qwen-convert``."""

import sys

from .cli import convert_main

sys.exit(convert_main())
