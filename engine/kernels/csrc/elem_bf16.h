// Storage-type macros for instantiating ops_impl.h, attention_impl.h and kv_fp8_impl.h on
// bf16 rows (see ops_impl.h for what each one means).
#define ELEM bf16_t
#define ELEM_IS_BF16 1
#define S_LOAD(x) bf16_to_f32(x)
#define S_STORE(x) f32_to_bf16(x)
#define S_ROUND(x) round_bf16(x)
#define V_LOAD vf_load_bf16
#define V_STORE vf_store_bf16
#define V_ROUND vf_round_bf16
