// The Vercel AI SDK's default OpenAI model (`openai(model)`: the Responses API) against a
// server, as a Node user calls it: `generateText`, then `streamText`, once each.
//
//   node vercel_ai_sdk.mjs BASE_URL MODEL PROMPT MAX_OUTPUT_TOKENS TEMPERATURE
//
// BASE_URL is the server's OpenAI base (`http://127.0.0.1:8000/v1`); the key is
// $OPENAI_API_KEY's, or "unused". Prints one JSON object for tests/chat_api/test_vercel_ai_sdk.py
// to assert on; an error's message, and its cause's, go to stderr with exit status 1.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";

const [baseURL, model, prompt, maxOutputTokens, temperature] = process.argv.slice(2);
if (temperature === undefined) {
  console.error("usage: node vercel_ai_sdk.mjs BASE_URL MODEL PROMPT MAX_OUTPUT_TOKENS TEMPERATURE");
  process.exit(2);
}
const openai = createOpenAI({ baseURL, apiKey: process.env.OPENAI_API_KEY ?? "unused" });
const request = {
  model: openai(model),
  prompt,
  maxOutputTokens: Number(maxOutputTokens),
  temperature: Number(temperature),
  maxRetries: 0,
};

function usageOf(usage) {
  return {
    inputTokens: usage.inputTokens,
    outputTokens: usage.outputTokens,
    totalTokens: usage.totalTokens,
  };
}

async function generate() {
  const result = await generateText(request);
  return {
    text: result.text,
    usage: usageOf(result.usage),
    finishReason: result.finishReason,
    responseId: result.providerMetadata?.openai?.responseId ?? null,
    warnings: result.warnings ?? [],
  };
}

async function stream() {
  // An error in the stream comes as an `error` part (and `onError`), not as a rejection.
  const errors = [];
  const result = streamText({ ...request, onError: ({ error }) => errors.push(error) });
  const partTypes = [];
  const deltas = [];
  for await (const part of result.fullStream) {
    partTypes.push(part.type);
    if (part.type === "text-delta") {
      deltas.push(part.text);
    } else if (part.type === "error") {
      errors.push(part.error);
    }
  }
  if (errors.length > 0) {
    throw errors[0];
  }
  const providerMetadata = await result.providerMetadata;
  return {
    text: await result.text,
    usage: usageOf(await result.usage),
    finishReason: await result.finishReason,
    responseId: providerMetadata?.openai?.responseId ?? null,
    warnings: (await result.warnings) ?? [],
    partTypes,
    deltas,
  };
}

try {
  const generated = await generate();
  const streamed = await stream();
  console.log(JSON.stringify({ generateText: generated, streamText: streamed }));
} catch (error) {
  console.error(`${error?.name ?? "Error"}: ${error?.message ?? error}`);
  for (let cause = error?.cause; cause; cause = cause.cause) {
    console.error(`caused by: ${cause?.message ?? cause}`);
  }
  if (error?.responseBody) {
    console.error(`response body: ${error.responseBody}`);
  }
  process.exit(1);
}
