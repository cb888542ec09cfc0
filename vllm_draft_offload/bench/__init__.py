"""The project's toolkit: fixture models, acceptance checks and benchmarks.

Run it through the ``vllm-draft-offload`` command (``cli.py``); import it from your
own code as ``vllm_draft_offload.bench.<area>.<module>``:

* ``fixtures``: the small KV-sensitive model family the checks run on;
* ``accept``: acceptance parity restored vs fresh, the KV-sensitivity probe, the
  docs' baseline tables, two engines sharing one storage directory;
* ``workloads``: the workload benchmark (ours vs vLLM's and LMCache's connectors);
* ``speed``: restore TTFT and storage-tier speed at real KV sizes, raw disk baselines;
* ``stress``: the pressure run and the soak with storage faults;
* ``serve``: ``vllm bench serve`` against ``vllm serve`` with and without the
  connector, its ``/metrics`` scrapes, and the Grafana dashboard rendered from them.

The connector (everything in ``vllm_draft_offload`` outside this package) never
imports it, and importing a subpackage loads neither torch nor vLLM: modules that
need them import them where they are used.
"""

from pathlib import Path

# The directory holding the ``vllm_draft_offload`` package. Engine subprocesses get it
# on PYTHONPATH, so they import the same copy of the package as their parent, also
# from an uninstalled source tree.
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
