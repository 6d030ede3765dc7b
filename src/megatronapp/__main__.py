"""`python -m megatronapp ...` (what torchrun runs with `-m megatronapp`)."""
import sys

from megatronapp.cli import main

sys.exit(main())
