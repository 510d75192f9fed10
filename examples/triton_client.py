"""Stream a completion from `k3-trt serve` over gRPC (needs only `pip install tritonclient[grpc]`).

    k3-trt serve examples/tiny-k3 &        # wait for "ready"
    python examples/triton_client.py --prompt "Hello" --max-tokens 16

The tensors are those of TensorRT-LLM's Triton backend, so clients written for it work
unchanged. Each streamed response carries the new tokens of one step: `output_ids` and
their `text_output` (the tiny example model has random weights: expect odd text).
"""
import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def tensor(name, value, dtype):
    array = np.array([[value]], dtype=dtype)  # a batch of one request holding one value
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint of the server")
    parser.add_argument("--model", default="k3")
    parser.add_argument("--prompt", default="Hello")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-stream", action="store_true", help="one response at the end")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for each response")
    args = parser.parse_args()

    inputs = [tensor("text_input", args.prompt.encode(), np.object_),
              tensor("max_tokens", args.max_tokens, np.int32),
              tensor("stream", not args.no_stream, np.bool_),
              tensor("temperature", args.temperature, np.float32),
              tensor("top_k", args.top_k, np.int32),
              tensor("top_p", args.top_p, np.float32),
              # Only the completion, also with --no-stream (TensorRT-LLM's default leads with the prompt).
              tensor("exclude_input_in_output", True, np.bool_)]
    if args.seed is not None:
        inputs.append(tensor("seed", args.seed, np.uint64))

    responses = queue.Queue()
    with grpcclient.InferenceServerClient(args.url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        # The empty final response tells the client that the request is over.
        client.async_stream_infer(args.model, inputs, request_id="1", enable_empty_final_response=True)
        ids = []
        while True:
            result, error = responses.get(timeout=args.timeout)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            response = result.get_response()
            if response.outputs:
                ids += result.as_numpy("output_ids").reshape(-1).tolist()
                print(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace"), end="", flush=True)
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    print(f"\n[{len(ids)} tokens] {ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
