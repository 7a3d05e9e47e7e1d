import OpenAI from "openai";

const client = new OpenAI({ baseURL: "https://api.openfill.ai/v1", apiKey: process.env.OPENFILL_API_KEY });

const stream = await client.chat.completions.create(
  {
    model: "placeholder-large",
    messages: [{ role: "user", content: "hello" }],
    stream: true,
    stream_options: { include_usage: true },
  },
  { headers: { "X-Max-Price": "0.10" } },
);
for await (const chunk of stream) {
  process.stdout.write(chunk.choices[0]?.delta?.content ?? "");
  if (chunk.usage) console.log("\n", chunk.usage); // carries x_market
}
