"""llm-lanes load generator: YAML scenarios of request streams, per-class latency/throughput report, config A/B runs.

    python -m load_tests.run --scenario load_tests/scenarios/mixed.yaml --url http://127.0.0.1:8000 \
        --out load_tests/results/mixed
"""
