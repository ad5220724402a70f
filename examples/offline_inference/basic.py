"""The seed's offline example: a few prompts, one SamplingParams, one LLM.generate call.

Run: python examples/offline_inference/basic.py
"""

from shmvllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)


def main() -> None:
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")
        print("-" * 60)
    llm.shutdown()


if __name__ == "__main__":
    main()
