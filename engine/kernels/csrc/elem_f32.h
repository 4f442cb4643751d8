// Storage-type macros for instantiating ops_impl.h, attention_impl.h and kv_fp8_impl.h on
// fp32 rows (see ops_impl.h for what each one means).
#define ELEM float
#define S_LOAD(x) (x)
#define S_STORE(x) (x)
#define S_ROUND(x) (x)
#define V_LOAD vf_load_f32
#define V_STORE vf_store_f32
#define V_ROUND vf_id
