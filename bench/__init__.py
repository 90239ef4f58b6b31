"""`pdserve bench`: replay a workload against the router and report what users feel.

workload/trace/presets build seeded request specs; dispatch sends them on time (with a progress
line); client replays them over gRPC, openai_client over any OpenAI-compatible HTTP server, and
both record when each streamed token arrived; metrics turns records into TTFT/ITL/TPOT/E2E,
throughput and goodput; report and plot write summary.json, requests.jsonl and charts; cli wires
the command.
"""
