"""melfeed's producer: the data side, N processes that build exactly the batches the consumer leased.

A process, not a library: it runs as ``melfeed producer`` and speaks only the wire protocol
(``shared/wire/``); it never imports ``consumer``. Nothing is re-exported here: import the module
you need (``melfeed.producer.worker``, ``melfeed.producer.batcher``, ``melfeed.producer.reader``,
``melfeed.producer.prepare.command``).
"""

__all__: list[str] = []
