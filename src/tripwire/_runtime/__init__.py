"""The machinery behind the public face, in the order data flows through it: the arena the kernels count into
(``arena``), the reader that copies it to the host (``reader``, with its native ticker in ``native``), the
confirmation of rises (``confirm``), the reporters and their window (``report``, rows decoded in ``hit``), and the
pipeline that joins them (``pipeline``); ``driver`` binds libcuda (once, for every caller), ``capture`` tells
whether a CUDA graph is being captured, ``default`` holds the process's default monitor, ``verdict_kernel`` the
same-step verdict's device copy.

Not public API: the names users import are re-exported by :mod:`tripwire` and its public modules.
"""
