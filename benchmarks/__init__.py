"""bench.py's benchmarks, one module per subject (bench.py only calls cli.main):

    cli.py          the command line: flags, the model, which run
    workloads.py    the named workloads and their requests
    engines.py      nanokv's variants, HF generate, HF continuous batching, vLLM
    peers/          the CPU peers: CTranslate2 (ct2.py), llama.cpp (llamacpp.py)
    throughput.py   one workload through every engine: its report
    roofline.py     the work a workload needs over the machine's measured rate
    report.py       the throughput report's tables
    accuracy.py     --accuracy
    micro.py        --micro
    measure.py      Result, peak memory, device sync
    serve.py        `bench.py serve`: OpenAI-compatible servers under load
"""
