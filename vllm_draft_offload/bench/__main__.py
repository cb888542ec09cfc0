"""``python -m vllm_draft_offload.bench``: the ``vllm-draft-offload`` command."""

import sys

from vllm_draft_offload.bench.cli import main

sys.exit(main())
