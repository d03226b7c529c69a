//! The genai wrapper against a real HTTP provider test server speaking the OpenAI and
//! Anthropic protocols, streaming and not.

use std::time::Duration;

use kiln_llm::fake::{FakeProvider, Step};
use kiln_llm::{
    ChatModel, GenaiModel, LlmError, Message, ModelConfig, ModelEvent, ModelRequest, Provider,
    RetryPolicy, ToolSpec, complete_with_retries,
};
use serde_json::json;

fn model(provider: Provider, fake: &FakeProvider) -> GenaiModel {
    let config = ModelConfig {
        provider,
        model: "fake-model".into(),
        base_url: Some(fake.base_url.clone()),
        api_key: Some(secrecy::SecretString::from("test-key")),
        timeout: Duration::from_secs(10),
        retry: RetryPolicy::default(),
    };
    GenaiModel::new(&config).expect("client")
}

fn request() -> ModelRequest {
    ModelRequest {
        messages: vec![Message::system("be brief"), Message::user("what is 6*7?")],
        tools: vec![ToolSpec {
            name: "execute_code".into(),
            description: "run code".into(),
            parameters: json!({"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}),
        }],
        output_schema: None,
    }
}

async fn tool_round_trip(provider: Provider, stream: bool) {
    let fake = FakeProvider::start(vec![
        Step::tool("call_1", "execute_code", json!({"code": "print(6*7)"})),
        Step::Text("The answer is 42.".into()),
    ])
    .await
    .unwrap();
    let model = model(provider, &fake);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let events = stream.then_some(&tx);
    let mut request = request();
    let reply = model.complete(&request, events).await.unwrap();
    assert_eq!(
        reply.tool_calls.len(),
        1,
        "{provider:?} stream={stream}: {reply:?}"
    );
    assert_eq!(reply.tool_calls[0].name, "execute_code");
    assert_eq!(reply.tool_calls[0].arguments, json!({"code": "print(6*7)"}));
    assert_eq!(reply.usage.input_tokens, 11);
    request.messages.push(Message {
        role: kiln_llm::Role::Assistant,
        content: String::new(),
        tool_calls: reply.tool_calls.clone(),
        tool_call_id: None,
    });
    request.messages.push(Message::tool("call_1", "42\n"));
    let reply = model.complete(&request, events).await.unwrap();
    assert_eq!(reply.text, "The answer is 42.");
    // The tool result reached the provider in its own protocol.
    let sent = fake.requests()[1].to_string();
    assert!(sent.contains("call_1") && sent.contains("42\\n"), "{sent}");
    assert!(
        !sent.contains("test-key"),
        "the key goes in a header, not the body"
    );
    if stream {
        drop(tx);
        let mut seen = Vec::new();
        while let Some(event) = rx.recv().await {
            seen.push(event);
        }
        assert!(seen.contains(&ModelEvent::FirstToken));
        assert!(seen.iter().any(
            |e| matches!(e, ModelEvent::ToolCallStart { name, .. } if name == "execute_code")
        ));
        let text: String = seen
            .iter()
            .filter_map(|e| match e {
                ModelEvent::TextDelta(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "The answer is 42.");
    }
}

#[tokio::test]
async fn openai_protocol_with_tools() {
    tool_round_trip(Provider::OpenAiCompatible, false).await;
    tool_round_trip(Provider::OpenAiCompatible, true).await;
}

#[tokio::test]
async fn anthropic_protocol_with_tools() {
    tool_round_trip(Provider::Anthropic, false).await;
    tool_round_trip(Provider::Anthropic, true).await;
}

#[tokio::test]
async fn rate_limits_and_server_errors_are_retried_then_reported() {
    let policy = RetryPolicy {
        attempts: 3,
        base_delay: Duration::from_millis(10),
    };
    let fake = FakeProvider::start(vec![
        Step::Status(429),
        Step::Status(503),
        Step::Text("ok".into()),
    ])
    .await
    .unwrap();
    let model = model(Provider::OpenAiCompatible, &fake);
    let reply = complete_with_retries(&model, &request(), None, Duration::from_secs(5), policy)
        .await
        .unwrap();
    assert_eq!(reply.text, "ok");
    assert_eq!(fake.requests().len(), 3);

    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::Status(500));
    let model = self::model(Provider::OpenAiCompatible, &fake);
    let error = complete_with_retries(&model, &request(), None, Duration::from_secs(5), policy)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            LlmError::Server {
                status: 500,
                attempts: 3,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(fake.requests().len(), 3);

    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::Status(429));
    let model = self::model(Provider::Anthropic, &fake);
    let error = complete_with_retries(&model, &request(), None, Duration::from_secs(5), policy)
        .await
        .unwrap_err();
    assert!(
        matches!(error, LlmError::RateLimited { attempts: 3 }),
        "{error}"
    );

    let fake = FakeProvider::start(vec![Step::Status(401)]).await.unwrap();
    let model = self::model(Provider::OpenAiCompatible, &fake);
    let error = complete_with_retries(&model, &request(), None, Duration::from_secs(5), policy)
        .await
        .unwrap_err();
    assert!(matches!(error, LlmError::Auth { status: 401 }), "{error}");
    assert_eq!(fake.requests().len(), 1, "a refused key is not retried");
}

#[tokio::test]
async fn a_provider_that_hangs_times_out() {
    let fake = FakeProvider::start(vec![]).await.unwrap();
    fake.repeat(Step::Hang);
    let model = model(Provider::OpenAiCompatible, &fake);
    let policy = RetryPolicy {
        attempts: 2,
        base_delay: Duration::from_millis(10),
    };
    let started = std::time::Instant::now();
    let error = complete_with_retries(&model, &request(), None, Duration::from_millis(300), policy)
        .await
        .unwrap_err();
    assert!(matches!(error, LlmError::Timeout(_)), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(fake.requests().len(), 2);
}
