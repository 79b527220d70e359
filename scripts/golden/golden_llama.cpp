// Records llama.cpp's reference outputs for LeanStream's golden tests:
// prompt token ids, the logits after the prompt, and a greedy continuation.
//
// Build and run: see make_goldens.sh beside this file.
// Usage: golden_llama MODEL N_PREDICT [--fa on|off] [--ctx N] PROMPT... > out.jsonl
// (flash attention off unless --fa on is given; context 512 unless --ctx).
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void print_json_string(const std::string & s) {
    std::putchar('"');
    for (unsigned char c : s) {
        switch (c) {
            case '"': std::fputs("\\\"", stdout); break;
            case '\\': std::fputs("\\\\", stdout); break;
            case '\n': std::fputs("\\n", stdout); break;
            case '\t': std::fputs("\\t", stdout); break;
            case '\r': std::fputs("\\r", stdout); break;
            default:
                if (c < 0x20) std::printf("\\u%04x", c); else std::putchar(c);
        }
    }
    std::putchar('"');
}

static void print_ids(const std::vector<llama_token> & ids) {
    std::putchar('[');
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? ",%d" : "%d", ids[i]);
    std::putchar(']');
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL N_PREDICT PROMPT...\n", argv[0]);
        return 2;
    }
    const int n_predict = std::atoi(argv[2]);
    int first_prompt = 3;
    auto fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int n_ctx = 512;
    while (first_prompt + 1 < argc && std::string(argv[first_prompt]).rfind("--", 0) == 0) {
        const std::string opt = argv[first_prompt], val = argv[first_prompt + 1];
        if (opt == "--fa") {
            fa = val == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        } else if (opt == "--ctx") {
            n_ctx = std::atoi(val.c_str());
        } else {
            std::fprintf(stderr, "unknown option %s\n", opt.c_str());
            return 2;
        }
        first_prompt += 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    for (int a = first_prompt; a < argc; ++a) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_ctx;
        cp.n_batch = std::max(512, n_ctx);
        cp.n_threads = 2;
        cp.n_threads_batch = 2;
        cp.flash_attn_type = fa;
        // As llama.cpp's command-line tools run (the C API's default keeps a
        // full-size cache for sliding-window layers instead of their ring).
        cp.swa_full = false;
        llama_context * ctx = llama_init_from_model(model, cp);

        const std::string prompt = argv[a];
        std::vector<llama_token> ids(prompt.size() + 8);
        int n = llama_tokenize(vocab, prompt.c_str(), prompt.size(), ids.data(), ids.size(), true, true);
        if (n < 0) { std::fprintf(stderr, "tokenize failed\n"); return 1; }
        ids.resize(n);

        llama_batch batch = llama_batch_get_one(ids.data(), ids.size());
        if (llama_decode(ctx, batch)) { std::fprintf(stderr, "decode failed\n"); return 1; }
        const float * logits = llama_get_logits_ith(ctx, -1);
        std::vector<float> first(logits, logits + n_vocab);

        std::vector<llama_token> gen;
        // Per step: the two best (id, logit) pairs, so a consumer can tell a near-tie.
        std::vector<std::pair<int, float>> top2;
        llama_token tok = 0;
        for (int i = 0; i < n_predict; ++i) {
            const float * l = llama_get_logits_ith(ctx, -1);
            tok = std::max_element(l, l + n_vocab) - l;
            int second = tok == 0 ? 1 : 0;
            for (int v = 0; v < n_vocab; ++v) if (v != tok && l[v] > l[second]) second = v;
            top2.push_back({tok, l[tok]});
            top2.push_back({second, l[second]});
            if (llama_vocab_is_eog(vocab, tok)) break;
            gen.push_back(tok);
            llama_batch one = llama_batch_get_one(&tok, 1);
            if (llama_decode(ctx, one)) { std::fprintf(stderr, "decode failed\n"); return 1; }
        }

        std::vector<int> order(n_vocab);
        for (int i = 0; i < n_vocab; ++i) order[i] = i;
        std::partial_sort(order.begin(), order.begin() + 20, order.end(),
                          [&](int x, int y) { return first[x] > first[y]; });

        std::printf("{\"ctx\":%d,\"prompt\":", n_ctx);
        print_json_string(prompt);
        std::fputs(",\"prompt_ids\":", stdout);
        print_ids(ids);
        std::fputs(",\"greedy_ids\":", stdout);
        print_ids(gen);
        std::fputs(",\"step_top2\":[", stdout);
        for (size_t i = 0; i < top2.size(); i += 2)
            std::printf(i ? ",[[%d,%.6f],[%d,%.6f]]" : "[[%d,%.6f],[%d,%.6f]]",
                        top2[i].first, top2[i].second, top2[i + 1].first, top2[i + 1].second);
        std::fputs("]", stdout);
        std::fputs(",\"top_logits\":[", stdout);
        for (int i = 0; i < 20; ++i) std::printf(i ? ",[%d,%.6f]" : "[%d,%.6f]", order[i], first[order[i]]);
        std::fputs("],\"first_logits\":[", stdout);
        for (int i = 0; i < 32; ++i) std::printf(i ? ",%.6f" : "%.6f", first[i]);
        std::fputs("]}\n", stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
